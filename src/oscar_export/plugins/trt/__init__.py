"""TensorRT (>= 10.9) AOT Python plugins for the decode layer (a TensorRT engine built from the ONNX export).

NOT EXECUTED with a real TensorRT (its native library cannot be installed on the machines this project was
built on). ``shapes.py`` (shape rules, int32 extras, grids, all read from the launch plan) is plain Python and
tested; ``plugin.py`` is checked by TensorRT's own pure-Python ``tensorrt.plugin`` validators with only the
native module stubbed (tests/plugins/test_trt_plugin.py); it imports ``tensorrt.plugin`` lazily and raises
an ``ImportError`` naming what to install when it is missing.
"""

from .shapes import MERGE_PLUGIN, PLUGIN_NAMESPACE, SPLIT_PLUGIN, DecodeShapes, check_split_inputs


def register_plugins(*args, **kwargs):
    """Register ``oscar::OscarDecodeSplit`` and ``oscar::OscarDecodeMerge`` (see ``plugin.py``)."""
    from .plugin import register_plugins as _register

    return _register(*args, **kwargs)


__all__ = ["MERGE_PLUGIN", "PLUGIN_NAMESPACE", "SPLIT_PLUGIN", "DecodeShapes", "check_split_inputs", "register_plugins"]
