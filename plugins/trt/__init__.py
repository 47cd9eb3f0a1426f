"""TensorRT engine path (TensorRT-LLM <= 1.2 / plain TensorRT >= 10.9): AOT Python plugins for the decode layer.

NOT EXECUTED here: TensorRT cannot be installed on the machines this project was built on. ``shapes.py``
(shape rules, int32 extras, grids) is plain Python and tested; ``plugin.py`` imports ``tensorrt.plugin``
lazily and raises an ``ImportError`` naming what to install when it is missing.
"""

from .shapes import MERGE_PLUGIN, PLUGIN_NAMESPACE, SPLIT_PLUGIN, DecodeShapes, check_split_inputs


def register_plugins(*args, **kwargs):
    """Register ``oscar::OscarDecodeSplit`` and ``oscar::OscarDecodeMerge`` (see ``plugin.py``)."""
    from .plugin import register_plugins as _register

    return _register(*args, **kwargs)


__all__ = ["MERGE_PLUGIN", "PLUGIN_NAMESPACE", "SPLIT_PLUGIN", "DecodeShapes", "check_split_inputs", "register_plugins"]
