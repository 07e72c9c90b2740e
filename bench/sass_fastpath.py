#!/usr/bin/env python3
"""sass_fastpath.py — static instruction count of the fused update's fast path, per element.

Disassembles libforge (cuobjdump -sass, from the CUDA toolkit; no GPU needed), finds the
pipelined pass loop of the Hopper kernel wgrad_wgmma_kernel<false, UpdateSpec<rule, weight
format, state format>> (among its loops with MUFU instructions, the one with the fewest
global loads: the edge-tile loop loads per element) and walks it once around the way a batch
that FastMath accepted runs:
  - unconditional branches are followed;
  - the fast/exact split ("@P BRA P, target", a two-predicate branch) is taken;
  - a conditional branch over the want_sq block (its next instruction converts to fp64)
    is taken;
  - a conditional branch over a rare path is taken: an IEEE division's slow path (FCHK or a
    CALL before its target) or masked sub-word stores (STG.E.U8 / STG.E.U16: a skipped
    element's masks, where the fast path stores whole quads);
  - every other conditional branch falls through (listed: check they are not the hot path;
    with block states, the vote on skipped elements falls through to the usual path).
The count excludes the fp64 sum-of-squares block and covers loads, stores and loop control;
it is what the SASS says, not a device measurement (ncu's thread instructions per element
also include the main loop, the split-K and the by-products).

int8, int4 and fp8 states beside an SR weight run one pass per loop iteration (the loop is not
unrolled for them); other specs two. The walk counts the passes by their fast/exact splits,
two per pass for int8 and int4.

    python3 bench/sass_fastpath.py build-gpu/libforge.so 2,1,1 2,2,2
    python3 bench/sass_fastpath.py build-gpu/libforge.so 2,2,2 --run-scalars

--run-scalars walks the run-scalars twins instead (UpdateSpec<..., true>: the kernels a CUDA
graph's step runs, reading the step's scalars from device memory). Each line also counts the
walk's loads (LDG global, LDS shared): scalars reloaded in the loop show up there.
"""
import collections
import re
import subprocess
import sys

ELEMENTS_PER_PASS = 8  # kQ = 2 quads of 4 per thread and pass


def op(text: str) -> str:
    return re.sub(r"^@!?U?P\w+\s+", "", text).split()[0].split(".")[0]


def functions(sass: str):
    for chunk in re.split(r"\n\s+Function : ", sass)[1:]:
        name = chunk.split("\n", 1)[0].strip()
        rows = []
        for line in chunk.split("\n"):
            m = re.match(r"\s+/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
            if m:
                rows.append((int(m.group(1), 16), m.group(2)))
        yield name, rows


def loops(rows):
    at = {a: i for i, (a, _) in enumerate(rows)}
    for i, (a, t) in enumerate(rows):
        m = re.search(r"BRA\s+(?:!?U?P\d+,\s*)?0x([0-9a-f]+)", t)
        if op(t) == "BRA" and m and int(m.group(1), 16) < a and int(m.group(1), 16) in at:
            yield rows[at[int(m.group(1), 16)]:i + 1]


def rare(body, at, i, target):
    """Whether the instructions a branch at body[i] skips, up to its target, are a rare path."""
    if target not in at or at[target] <= i:
        return False
    skipped = body[i + 1:at[target]]
    return any(op(t) in ("FCHK", "CALL") or re.search(r"STG\.E\.U(8|16)\b", t) for _, t in skipped)


def walk(body):
    at = {a: i for i, (a, _) in enumerate(body)}
    start, end = body[0][0], body[-1][0]
    i, path, other, passes = 0, [], [], 0
    while i < len(body):
        a, t = body[i]
        path.append(t)
        if op(t) == "BRA":
            target = int(re.search(r"0x([0-9a-f]+)", t).group(1), 16)
            if a == end or target == start:
                break
            nxt = body[i + 1][1] if i + 1 < len(body) else ""
            split = re.match(r"@!?P\d BRA !?P\d, 0x", t)
            passes += 1 if split else 0
            if not t.startswith("@") or split or op(nxt) == "F2F" or rare(body, at, i, target):
                i = at[target]
                continue
            other.append(f"{a:#x} {t}")
        i += 1
    path = [t for t in path if op(t) not in ("F2F", "DMUL", "DADD")]
    return path, max(passes, 1), other


def main() -> int:
    args = [a for a in sys.argv[1:] if a != "--run-scalars"]
    run_scalars = len(args) < len(sys.argv) - 1
    if len(args) < 2:
        print(__doc__)
        return 2
    sass = subprocess.run(["cuobjdump", "-sass", args[0]], capture_output=True, text=True,
                          check=True).stdout
    for spec in args[1:]:
        r, w, s = spec.split(",")
        # UpdateSpec<rule, weight, state, run scalars> (false: the launch's own scalars)
        key = (f"wgrad_wgmma_kernelILb0ENS0_10UpdateSpecILi{r}ELi{w}ELi{s}"
               f"ELb{int(run_scalars)}EEE")
        found = [rows for name, rows in functions(sass) if key in name]
        if not found:
            print(f"{spec}: no wgrad_wgmma_kernel for UpdateSpec<{spec}> in {args[0]}")
            continue
        # (one function per architecture of the build: every pass but sm_90a has a stub)
        candidates = []
        for body in (b for rows in found for b in loops(rows)):
            ops = collections.Counter(op(t) for _, t in body)
            if ops["MUFU"] > 0:
                candidates.append((ops["LDG"], len(body), body))
        if not candidates:
            print(f"{spec}: no update loop found")
            continue
        body = min(candidates, key=lambda c: (c[0], c[1]))[2]
        path, passes, other = walk(body)
        if s in ("3", "5"):  # int8 and int4 states: two fast/exact splits per pass
            passes = max(passes // 2, 1)
        per_element = len(path) / (passes * ELEMENTS_PER_PASS)
        ops = collections.Counter(op(t) for t in path)
        counts = ops.most_common(8)
        name = f"UpdateSpec<{spec}{', run scalars' if run_scalars else ''}>"
        print(f"{name}: {len(path)} instructions over {passes} pass(es), "
              f"{per_element:.1f} per element, loads {ops['LDG']} LDG / {ops['LDS']} LDS; "
              f"top opcodes {dict(counts)}")
        for line in other:
            print("  fell through:", line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
