"""An artifact with 4-bit keys in named layers (issue 17's ablation: a layer set chosen by a diagnosis, not by
``calibrate --key-bits-budget``), written as calibration would write it (``key_bits.widen_keys``: clip 1 there).

    python benchmarks/artifact_key_bits.py SRC_ARTIFACT OUT_DIR --k4 6-8,14-24,28
"""
import argparse
import sys
from dataclasses import replace

from oscar_export.calibration.artifact import load_artifact
from oscar_export.calibration.key_bits import WIDE_BITS, parse_layers, widen_keys


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("src", help="a 2-bit artifact directory (its transforms are kept in the 2-bit layers)")
    ap.add_argument("out", help="output artifact directory")
    ap.add_argument("--k4", required=True, help="layers with 4-bit keys, e.g. 6-8,14-24,28")
    args = ap.parse_args(argv)
    art = load_artifact(args.src)
    if art.mixed_key_bits:
        raise SystemExit(f"{args.src}: already has mixed key bits; start from a 2-bit artifact")
    wide = set(parse_layers(args.k4))
    n = len(art.transforms)
    if not wide <= set(range(n)):
        raise SystemExit(f"--k4: layers {sorted(wide - set(range(n)))} not in 0..{n - 1}")
    bits = tuple(WIDE_BITS if i in wide else art.layout.key.bits for i in range(n))
    out = replace(art, key_bits=bits, transforms=widen_keys(art.transforms, bits, art.layout),
                  config={**art.config, "key_bits_layers": args.k4})
    out.save(args.out)
    print(f"{args.out}: 4-bit keys in {sorted(wide)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
