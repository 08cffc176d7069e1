"""The house drawn from the includes (ARCHITECTURE.md §2, "Code depends downwards only"): every `#include "x/..."`
of a project file in core/, profiler/, baselines/, verify/ and experiments/ names a file of its own layer or of one
listed above it in §2's two tables (core's layers in order, then the top-level folders in order). The tables are read
from ARCHITECTURE.md itself, so the drawing and the check cannot drift apart. Negative control: a copy of the tree in
which core/io includes core/training fails, naming the file and the include.

Usage: python tests/cli/cli_layers.py BUILD/streambp   (the binary is not used)
"""
import re
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FOLDERS = ("core", "profiler", "baselines", "verify", "experiments")


def layer_order(architecture):
    """§2's tables, top to bottom: core's layers, then the top-level folders (core itself among them)."""
    section = architecture.split("## 2. Layers", 1)[1].split("\n## ", 1)[0]
    names = re.findall(r"^\| `([a-z_/]+)` \|", section, re.M)
    core = [n for n in names if n.startswith("core/") and n != "core/"]
    top = [n.rstrip("/") for n in names if n.endswith("/")]
    assert core and "core" in top, f"§2's tables not found in ARCHITECTURE.md: {names}"
    return core, top


def place(path):
    """A file's layer: core/<layer> inside core, else its top-level folder."""
    parts = Path(path).parts
    if parts[0] == "core" and len(parts) > 2:
        return f"core/{parts[1]}"
    return parts[0]


def upward_includes(root):
    core, top = layer_order((root / "ARCHITECTURE.md").read_text())
    rank = {name: (top.index("core"), i) for i, name in enumerate(core)}
    rank.update({name: (i, 0) for i, name in enumerate(top) if name != "core"})
    up, checked = [], 0
    for folder in FOLDERS:
        for source in sorted((root / folder).rglob("*")):
            if source.suffix not in (".h", ".cpp", ".cu", ".cuh") or not source.is_file():
                continue
            here = place(source.relative_to(root))
            for include in re.findall(r'^\s*#\s*include\s+"([^"]+)"', source.read_text(errors="replace"), re.M):
                if Path(include).parts[0] not in FOLDERS:
                    continue  # a file beside it, or a system header
                there = place(include)
                checked += 1
                if there not in rank or here not in rank:
                    up.append(f"{source.relative_to(root)} includes {include}: {there if there not in rank else here} "
                              "is in neither of §2's tables")
                elif rank[there] > rank[here]:
                    up.append(f"{source.relative_to(root)} includes {include} ({here} -> {there}, upwards)")
    return checked, up


checked, up = upward_includes(ROOT)
print(f"{checked} project includes checked against ARCHITECTURE.md §2")
if up:
    print("FAIL: includes that run up the house:\n  " + "\n  ".join(up))
    sys.exit(1)

with tempfile.TemporaryDirectory() as scratch:
    copy = Path(scratch)
    shutil.copy(ROOT / "ARCHITECTURE.md", copy)
    for folder in FOLDERS:
        shutil.copytree(ROOT / folder, copy / folder, ignore=shutil.ignore_patterns("*.py", "*.json", "*.md"))
    spec = copy / "core" / "io" / "spec.cpp"
    spec.write_text('#include "core/training/trainer.h"\n' + spec.read_text())
    _, planted = upward_includes(copy)
    if planted != ["core/io/spec.cpp includes core/training/trainer.h (core/io -> core/training, upwards)"]:
        print(f"FAIL: the negative control (core/io including core/training) gave {planted}")
        sys.exit(1)
print("ok: no include runs up the house; a planted one (core/io -> core/training) is named")
