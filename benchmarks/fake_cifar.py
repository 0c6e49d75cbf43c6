"""Random uint8 pixels in CIFAR-100's python layout, for timing training where nothing can be downloaded (same
shapes, same augmentation, so the same speed; accuracy means nothing). Loads with the data option
``verify_md5: false``. Kept if already there with the same sizes (a second suite call reuses it).

    python benchmarks/fake_cifar.py DIR [--train 50000] [--test 10000]      # writes DIR/cifar-100-python/
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
from pathlib import Path

import numpy as np


def write(root: Path, train: int, test: int, classes: int = 100) -> bool:
    """Write the three files (atomically each); False if ``root`` already holds this layout and size."""
    folder = root / "cifar-100-python"
    stamp = folder / "fake.json"
    want = {"train": train, "test": test, "classes": classes}
    if stamp.exists() and json.loads(stamp.read_text()) == want:
        return False
    folder.mkdir(parents=True, exist_ok=True)
    g = np.random.default_rng(0)

    def dump(name: str, obj) -> None:
        tmp = folder / f".{name}.tmp"
        with open(tmp, "wb") as f:
            pickle.dump(obj, f, protocol=4)
        os.replace(tmp, folder / name)

    for name, n in (("train", train), ("test", test)):
        labels = g.integers(0, classes, n).tolist()
        dump(name, {"data": g.integers(0, 256, (n, 3072), dtype=np.uint8), "fine_labels": labels,
                    "coarse_labels": [y // 5 for y in labels]})
    dump("meta", {"fine_label_names": [f"class{i}" for i in range(classes)],
                  "coarse_label_names": [f"group{i}" for i in range(classes // 5)]})
    stamp.write_text(json.dumps(want))
    return True


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("root", type=Path)
    p.add_argument("--train", type=int, default=50000)
    p.add_argument("--test", type=int, default=10000)
    args = p.parse_args()
    made = write(args.root, args.train, args.test)
    print(f"# {args.train} training and {args.test} test images of random pixels in CIFAR-100's layout under "
          f"{args.root} ({'written' if made else 'already there'})")


if __name__ == "__main__":
    main()
