# ctest-timeout: 300
# ctest-cost: 35
"""Every `build/streambp ...` command in README.md and docs/*.md is one the binary accepts (issue #46 item 6).

For each command in a fenced code block (continuation lines joined, `# comments` dropped, a token with `...` taken
as elided):
- its first word names a command of `streambp --help`;
- every `--flag` is one that `streambp <command> --help` lists;
- the command line with `--help` appended exits 0: CLI11 then converts and validates every value (a method spec, a
  number, a choice) but runs no work. A path the text names and the reader makes first ("File does not exist") is
  created empty in a scratch folder and the line is parsed again.
CLI11 prints the help without looking at unknown flags, so the names are checked against the listing, not by the exit.

Negative control: a temporary page holding a misspelt flag, an unknown command and a bad method option must fail
with each named, and a page of valid commands must pass.

Usage: python tests/cli/cli_doc_commands.py BUILD/streambp [FILE.md ...]   (default: README.md and docs/*.md)
"""
import concurrent.futures
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
INVOCATION = re.compile(r"(?:^|[\s;&|(])(?:\S*/)?build/streambp(?=\s|$)")
MISSING_PATH = re.compile(r"(File|Directory|Path) does not exist: (.+)")


def doc_commands(path):
    """(line number, argument list) of every streambp command in the file's fenced code blocks."""
    commands, in_block, pending, start = [], False, "", 0
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_block, pending = not in_block, ""
            continue
        if not in_block:
            continue
        if not pending:
            start = number
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        match = INVOCATION.search(text)
        if not match:
            continue
        words = []
        for word in shlex.split(text[match.end():], comments=True):
            if word in ("|", "||", "&&", ";") or word.startswith(">") or word.startswith("2>"):
                break
            if "..." not in word:
                words.append(word)
        commands.append((start, words))
    return commands


class Binary:
    def __init__(self, path):
        self.path = str(Path(path).resolve())
        self.commands = self.names(self.help(), "Subcommands:")
        self.flags = {}

    def help(self, *args):
        return subprocess.run([self.path, *args, "--help"], capture_output=True, text=True).stdout

    @staticmethod
    def names(listing, section=None):
        """The first column of a CLI11 listing: command names under `section`, or every --flag."""
        if section:
            lines = listing.split(section, 1)[1].splitlines() if section in listing else []
            return {m.group(1) for m in (re.match(r"^  (\S+)", l) for l in lines) if m}
        flags = set()
        for line in listing.splitlines():
            m = re.match(r"^  (-\S+)", line)
            if m:
                flags.update(n for n in m.group(1).split(",") if n.startswith("--"))
        return flags

    def flags_of(self, command):
        if command not in self.flags:
            self.flags[command] = self.names(self.help(command))
        return self.flags[command]

    def parses(self, words, scratch):
        """'' when `words --help` parses, else CLI11's message; paths it asks for are made in `scratch`."""
        for _ in range(8):
            p = subprocess.run([self.path, *words, "--help"], capture_output=True, text=True, cwd=scratch)
            if p.returncode == 0:
                return ""
            stderr = p.stderr.replace("streambp: error: ", "")  # the CLI's prefix of every input error
            missing = MISSING_PATH.search(stderr)
            if not missing:
                return (stderr.strip() or p.stdout.strip()).splitlines()[0]
            kind, name = missing.group(1), missing.group(2).strip()
            target = Path(scratch) / name.lstrip("/~")  # an absolute path is made inside the scratch folder too
            if target.exists():
                return stderr.strip().splitlines()[0]
            if kind == "Directory":
                target.mkdir(parents=True)
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                target.touch()
            words = [str(target) if w == name else w for w in words]
        return "too many missing paths"


def check_files(binary, files):
    """Every problem found, as 'FILE:LINE: what', and the number of commands found."""
    problems, to_parse, found = [], [], 0
    for path in files:
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        for line, words in doc_commands(path):
            found += 1
            at = f"{where}:{line}"
            if not words or words[0] not in binary.commands:
                problems.append(f"{at}: unknown command '{words[0] if words else ''}'")
                continue
            known = binary.flags_of(words[0])
            unknown = [w.split("=")[0] for w in words if w.startswith("--") and w.split("=")[0] not in known]
            if unknown:
                problems.append(f"{at}: {words[0]} has no option {', '.join(unknown)}")
                continue
            to_parse.append((at, words))
    with tempfile.TemporaryDirectory() as scratch, concurrent.futures.ThreadPoolExecutor(2) as pool:
        dirs = [Path(scratch) / str(i) for i in range(len(to_parse))]
        for d in dirs:
            d.mkdir()
        for (at, words), message in zip(to_parse, pool.map(binary.parses, [w for _, w in to_parse], dirs)):
            if message:
                problems.append(f"{at}: {' '.join(words[:1])}: {message}")
    return problems, found


def negative_control(binary):
    """A page with three wrong commands fails naming each; one with right ones passes."""
    ok = True
    with tempfile.TemporaryDirectory() as tmp:
        bad = Path(tmp) / "bad.md"
        bad.write_text("text\n\n```sh\nbuild/streambp run --presett tiny --method standard --seq 8\n"
                       "build/streambp rnu --preset tiny\n"
                       "build/streambp run --preset tiny --seq 8 \\\n    --method streambp:layer_chnk=8\n```\n")
        problems, _ = check_files(binary, [bad])
        for expected in ("bad.md:4: run has no option --presett", "bad.md:5: unknown command 'rnu'",
                         "bad.md:6: run: --method: method 'streambp': unknown option 'layer_chnk'"):
            if not any(expected in p for p in problems):
                print(f"FAIL: negative control: no '{expected}' among {problems}")
                ok = False
        good = Path(tmp) / "good.md"
        good.write_text("```\n# a comment\nbuild/streambp compare a.safetensors b.safetensors --rtol 1e-10  # why\n"
                        "torchrun --nproc-per-node 2 --no-python build/streambp train ...same arguments... --sp 2\n```\n")
        problems, found = check_files(binary, [good])
        if problems or found != 2:
            print(f"FAIL: negative control: a valid page gave {problems} ({found} of 2 commands found)")
            ok = False
    if ok:
        print("ok: negative control: a misspelt flag, an unknown command and a bad method option are each named")
    return ok


def main():
    binary = Binary(sys.argv[1])
    if not binary.commands:
        print(f"FAIL: {sys.argv[1]} --help lists no commands")
        return 1
    files = [Path(f).resolve() for f in sys.argv[2:]] or [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
    ok = negative_control(binary)
    problems, found = check_files(binary, files)
    for p in problems:
        print("FAIL:", p)
    if found == 0:
        print("FAIL: no streambp command found in", [str(f) for f in files])
        return 1
    if not problems:
        print(f"ok: {found} commands in {len(files)} files parse")
    return 0 if ok and not problems else 1


if __name__ == "__main__":
    sys.exit(main())
