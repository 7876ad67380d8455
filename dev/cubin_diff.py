"""Machine code of two kernel-source trees, function by function (no GPU needed).

    python3 dev/cubin_diff.py OLD_KERNELS_SRC NEW_KERNELS_SRC [--arch 80 90] [--list]

Compiles every shipped kernel from each tree with NVRTC (`kforge.compile_all`, through
KFORGE_KERNEL_DIR, each into its own cache directory) and compares each function's `.text` section in
the cubins. Identical sections mean identical SASS: a refactor of kernel sources that changes none
needs no timing A/B. Differing functions are listed per op with their code sizes (`--list`: every
function). Needs pyelftools (`pip install pyelftools`).
"""
import argparse
import glob
import io
import os
import subprocess
import sys
import tempfile


def _compile(kernel_dir: str, cache: str, archs: list[int]) -> None:
    env = dict(os.environ, KFORGE_KERNEL_DIR=os.path.abspath(kernel_dir), KFORGE_CACHE_DIR=cache)
    code = f"import kforge\nfor a in {archs!r}: kforge.compile_all(a)"
    subprocess.run([sys.executable, "-c", code], env=env, check=True)


def _functions(cache: str) -> dict:
    """{(op, arch, mangled function): its .text bytes} of every cubin in a kforge cache directory."""
    from elftools.elf.elffile import ELFFile

    out = {}
    for path in glob.glob(os.path.join(cache, "*.cubin")):
        op, arch = os.path.basename(path).split("-")[:2]
        raw = open(path, "rb").read()
        elf = ELFFile(io.BytesIO(raw[raw.index(b"\x7fELF"):]))  # after kforge's cache header
        for sec in elf.iter_sections():
            if sec.name.startswith(".text."):
                out[(op, arch, sec.name[len(".text."):])] = sec.data()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("old")
    ap.add_argument("new")
    ap.add_argument("--arch", type=int, nargs="+", default=[80, 90])
    ap.add_argument("--list", action="store_true", help="print every differing function")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        old_cache, new_cache = os.path.join(tmp, "old"), os.path.join(tmp, "new")
        _compile(args.old, old_cache, args.arch)
        _compile(args.new, new_cache, args.arch)
        a, b = _functions(old_cache), _functions(new_cache)
    common = sorted(set(a) & set(b))
    differ = [k for k in common if a[k] != b[k]]
    print(f"{len(common)} functions in both trees, {len(common) - len(differ)} identical, {len(differ)} differ; "
          f"{len(set(a) - set(b))} only in old, {len(set(b) - set(a))} only in new")
    per_op: dict = {}
    for k in differ:
        per_op.setdefault((k[0], k[1]), []).append(k)
    for (op, arch), ks in sorted(per_op.items()):
        print(f"  {op} {arch}: {len(ks)} functions differ")
        if args.list:
            for k in ks:
                print(f"    {k[2]}: {len(a[k])} -> {len(b[k])} bytes")


if __name__ == "__main__":
    main()
