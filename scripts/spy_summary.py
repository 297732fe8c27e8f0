"""Sum py-spy's raw samples (``py-spy record -f raw``) under one frame: where the samples that
pass through ``--root`` go next (``--depth`` frames below it), and their innermost frames.

    python scripts/spy_summary.py spy-default.txt --root "ModelRunner.launch (" --depth 1

A frame is ``Qualified.name (file.py:line)``; lines are dropped unless ``--lines``, so a
function's samples add up across its lines. With ``--native`` samples the innermost frames are
MLX's C++ (what ``submit`` spends).
"""

from __future__ import annotations

import argparse
import collections
import re

FRAME = re.compile(r" \((?:.*/)?([^/:]+):(\d+)\)$")


def short(frame: str, lines: bool) -> str:
    m = FRAME.search(frame)
    if not m:
        return frame
    name = frame[: m.start()]
    return f"{name} {m.group(1)}:{m.group(2)}" if lines else f"{name} {m.group(1)}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("path")
    ap.add_argument("--root", default="OverlapLoop._step (")
    ap.add_argument("--depth", type=int, default=1)
    ap.add_argument("--lines", action="store_true")
    ap.add_argument("--top", type=int, default=25)
    args = ap.parse_args()
    below: collections.Counter[str] = collections.Counter()
    leaf: collections.Counter[str] = collections.Counter()
    total = everything = 0
    with open(args.path) as f:
        for line in f:
            stack, _, n = line.rstrip().rpartition(" ")
            if not n.isdigit():
                continue
            everything += int(n)
            frames = stack.split(";")
            at = next((i for i, fr in enumerate(frames) if fr.startswith(args.root)), None)
            if at is None:
                continue
            total += int(n)
            sub = frames[at + 1 : at + 1 + args.depth]
            below[" > ".join(short(fr, args.lines) for fr in sub) or "(itself)"] += int(n)
            leaf[short(frames[-1], args.lines)] += int(n)
    print(f"{total} of {everything} samples under {args.root!r}")
    for key, n in below.most_common(args.top):
        print(f"{n:7d} {100 * n / max(total, 1):5.1f}%  {key}")
    print("innermost frames:")
    for key, n in leaf.most_common(args.top):
        print(f"{n:7d} {100 * n / max(total, 1):5.1f}%  {key}")


if __name__ == "__main__":
    main()
