"""Every code block, command, path and link in README.md and docs/**/*.md is checked, without training:

- a ```python block runs in a fresh namespace (a `get_config()` it defines must return a `Config`); a block
  right after `<!-- docs-test: compile -->` uses names only a trained run has: it compiles and its imports run;
  one after `<!-- docs-test: file NAME -->` is a file the reader saves as NAME (a config of their own): it is
  written to a temporary directory, loaded with `load_config` when it defines `get_config`, and the page's
  commands that name NAME use it;
- in a ```bash / ```sh block, a `jaxrl ...` (or `.venv/bin/jaxrl ...`) command parses with the real parser
  (`jaxrl.cli.build_parser`), and `train` / `eval` load their CONFIG with the line's `--set` overrides
  (`jaxrl.config.load_config`); `make X` names a Makefile target and its CONFIG= / ARGS= load the same way;
  every scripts/, benchmarks/ or configs/ path in a command exists, and a launcher's config loads with its
  `--set` overrides;
- every relative link (with its #anchor) between the pages resolves, and every repository path written in
  the text (jaxrl/..., configs/..., tests/..., ...) exists;
- README's "Layout" lists every module and package of jaxrl/, and nothing else.

Running the commands for real is too slow for the suite (each trains a run: minutes on CPU, the GPU
recipes hours), so a command is checked up to the point where it would start to work. The loss
example's numbers are checked by test_loss_evaluate.py, the launchers' dry runs by test_scripts.py.
Other fences (```text) are not checked; an indented code block is refused, so no command escapes.
"""

import ast
import os
import pathlib
import re
import shlex
from dataclasses import dataclass

import pytest
from conftest import REPO

from jaxrl.cli import build_parser
from jaxrl.config import Config, ConfigError, load_config

PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
COMPILE_ONLY = "<!-- docs-test: compile -->"
AS_FILE = re.compile(r"<!-- docs-test: file (\S+) -->")
SHELLS = ("bash", "sh", "shell", "console")
LANGS = ("python", "text", *SHELLS)
REPO_PATH = re.compile(r"(?<![\w./~-])((?:jaxrl|configs|scripts|benchmarks|tests|docs)/[\w./+-]*)")
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
# Written on another branch (issue 31's "bring your own" examples): drop from here once merged.


@dataclass(frozen=True)
class Block:
    where: str  # page:line of the opening fence
    lang: str
    text: str
    compile_only: bool
    file: str | None  # the name the reader saves it under (<!-- docs-test: file NAME -->)

    @property
    def page(self):
        return REPO / self.where.rsplit(":", 1)[0]


def _rel(page) -> str:
    return page.relative_to(REPO).as_posix() if page.is_relative_to(REPO) else str(page)


def split_page(page) -> tuple[list[Block], list[tuple[int, str]]]:
    """The fenced blocks of a page, and its other lines (numbered) as prose."""
    blocks, prose, fence, previous = [], [], None, ""
    for n, line in enumerate(page.read_text().splitlines(), 1):
        if fence is None and line.startswith("```"):
            fence = (n, line[3:].strip(), [], previous.strip())
        elif fence is not None and line.startswith("```"):
            start, lang, body, marker = fence
            as_file = AS_FILE.fullmatch(marker)
            text = "\n".join(body) + "\n"
            blocks.append(Block(f"{_rel(page)}:{start}", lang, text, marker == COMPILE_ONLY, as_file and as_file[1]))
            fence = None
        elif fence is not None:
            fence[2].append(line)
        else:
            prose.append((n, line))
        if line.strip():
            previous = line
    assert fence is None, f"{_rel(page)}:{fence[0]}: a code fence is never closed"
    return blocks, prose


def all_blocks() -> list[Block]:
    return [b for page in PAGES for b in split_page(page)[0]]


def shell_commands(text: str) -> list[list[str]]:
    """The simple commands of a shell block: continuation lines joined, comments dropped, split at
    ; & && | ||, leading VAR=value assignments removed."""
    commands = []
    for line in text.replace("\\\n", " ").splitlines():
        lex = shlex.shlex(line, posix=True, punctuation_chars=True)
        lex.whitespace_split = True
        current = []
        for token in [*lex, ";"]:
            if token and set(token) <= set(";&|"):
                while current and re.match(r"^[A-Za-z_]\w*=", current[0]):
                    current.pop(0)
                if current:
                    commands.append(current)
                current = []
            else:
                current.append(token)
    return commands


def makefile_targets() -> set[str]:
    return set(re.findall(r"^([\w.-]+):", (REPO / "Makefile").read_text(), re.MULTILINE))


def makefile_default(name: str) -> str:
    return re.findall(rf"^{name}\s*\?=\s*(\S+)", (REPO / "Makefile").read_text(), re.MULTILINE)[0]


def _overrides(args: list[str]) -> list[str]:
    return [args[i + 1] for i, a in enumerate(args[:-1]) if a == "--set"]


def page_files(page, directory) -> dict[str, pathlib.Path]:
    """The page's `docs-test: file` blocks, saved under their names in `directory`."""
    files = {}
    for block in split_page(page)[0]:
        if block.file:
            files[block.file] = directory / block.file
            files[block.file].write_text(block.text)
    return files


def _config_problem(config: str, overrides: list[str], files: dict) -> str | None:
    path = files.get(config, REPO / config)
    if not path.is_file():
        return f"{config} does not exist"
    try:
        load_config(path, overrides)
    except ConfigError as e:
        return f"config {config} with --set {overrides}: {e}"
    return None


def command_problems(argv: list[str], files: dict | None = None) -> list[str]:
    """What is wrong with one documented command ([] when it would start); `files`: the page's own."""
    files = files or {}
    problems = [
        f"{t} does not exist" for t in argv if re.match(r"(scripts|benchmarks|configs)/", t) and not (REPO / t).exists()
    ]
    prog = argv[0]
    if os.path.basename(prog) == "jaxrl":
        if prog not in ("jaxrl", ".venv/bin/jaxrl"):
            problems.append(f"{prog}: the command is `jaxrl` or `.venv/bin/jaxrl`")
        try:
            args = build_parser().parse_args(argv[1:])
        except SystemExit:
            return [*problems, f"`jaxrl` refuses the arguments {argv[1:]}"]
        if args.command in ("train", "eval"):
            problems.append(_config_problem(args.config, args.overrides, files))
    elif prog == "make":
        targets = [a for a in argv[1:] if "=" not in a and not a.startswith("-")]
        problems += [f"make {t}: no such Makefile target" for t in targets if t not in makefile_targets()]
        assigned = dict(a.split("=", 1) for a in argv[1:] if "=" in a)
        if "train" in targets or "CONFIG" in assigned or "ARGS" in assigned:
            config = assigned.get("CONFIG") or makefile_default("CONFIG")
            problems.append(_config_problem(config, _overrides(shlex.split(assigned.get("ARGS", ""))), files))
    elif prog.startswith("scripts/"):
        configs = [i for i, a in enumerate(argv) if re.match(r"configs/.*\.py$", a)]
        if configs:
            problems.append(_config_problem(argv[configs[0]], _overrides(argv[configs[0] :]), files))
    return list(dict.fromkeys(p for p in problems if p))


def link_problems(page, line: str) -> list[str]:
    problems = []
    for target in LINK.findall(line):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            problems.append(f"link {target}: {path} does not exist")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            problems.append(f"link {target}: {_rel(dest)} has no heading #{anchor}")
    return problems


def anchors(page) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    headings = [line for _, line in split_page(page)[1] if line.startswith("#")]
    return {re.sub(r"[^\w\- ]", "", h.lstrip("#").strip().lower()).replace(" ", "-") for h in headings}


def path_problems(line: str) -> list[str]:
    paths = (p.rstrip(".,:;-") for p in REPO_PATH.findall(line))
    return [f"{p} does not exist" for p in paths if not (REPO / p).exists()]


def _ids(blocks: list[Block]) -> list[str]:
    return [b.where for b in blocks]


PYTHON = [b for b in all_blocks() if b.lang == "python"]
SHELL = [b for b in all_blocks() if b.lang in SHELLS]


@pytest.mark.parametrize(
    "block", [pytest.param(b, marks=[pytest.mark.slow] * ("import jax" in b.text)) for b in PYTHON], ids=_ids(PYTHON)
)
def test_python_block_runs(block, tmp_path):
    code = compile(block.text, block.where, "exec")
    namespace = {"__name__": "docs_example"}
    if block.file and "def get_config(" in block.text:
        cfg = load_config(page_files(block.page, tmp_path)[block.file])
        assert isinstance(cfg, Config), f"{block.where}: get_config() returns no Config"
        return
    if block.compile_only:
        for node in ast.parse(block.text).body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                exec(compile(ast.Module([node], []), block.where, "exec"), namespace)
        return
    exec(code, namespace)
    if "get_config" in namespace:
        assert isinstance(namespace["get_config"](), Config), f"{block.where}: get_config() returns no Config"


@pytest.mark.parametrize("block", SHELL, ids=_ids(SHELL))
def test_shell_block_commands_would_start(block, tmp_path):
    commands = shell_commands(block.text)
    assert commands, f"{block.where}: a shell block with no command"
    files = page_files(block.page, tmp_path)
    problems = [f"{' '.join(c)}: {p}" for c in commands for p in command_problems(c, files)]
    assert not problems, f"{block.where}:\n" + "\n".join(problems)


def test_every_block_is_fenced_with_a_known_language():
    problems = []
    for page in PAGES:
        blocks, prose = split_page(page)
        problems += [f"{b.where}: fence language {b.lang!r}" for b in blocks if b.lang not in LANGS]
        misplaced = [b for b in blocks if b.compile_only and b.lang != "python"]
        problems += [f"{b.where}: {COMPILE_ONLY} before a {b.lang} block" for b in misplaced]
        lines = dict(prose)
        for n, line in prose:
            starts_code = not lines.get(n - 1, "x").strip() and not re.match(r"\s*([-*]|\d+\.) ", line)
            if line.startswith("    ") and line.strip() and starts_code:
                problems.append(f"{_rel(page)}:{n}: an indented code block: fence it (```bash, ```text)")
    assert not problems, "\n".join(problems)


def test_links_and_paths_resolve():
    problems = []
    for page in PAGES:
        for n, line in split_page(page)[1]:
            problems += [f"{_rel(page)}:{n}: {p}" for p in link_problems(page, line) + path_problems(line)]
    assert not problems, "\n".join(problems)


def test_readme_layout_lists_every_module():
    readme = (REPO / "README.md").read_text()
    layout = readme[readme.index("\n## Layout\n") :]
    listed = re.findall(r"^(jaxrl/\S+)", layout, re.MULTILINE)
    modules = {p.relative_to(REPO).as_posix() for p in (REPO / "jaxrl").rglob("*.py") if p.name != "__init__.py"}
    packages = {p.parent.relative_to(REPO).as_posix() + "/" for p in (REPO / "jaxrl").rglob("__init__.py")}
    want = modules | packages - {"jaxrl/"}
    assert not (missing := sorted(want - set(listed))), f"README's Layout lists no line for {missing}"
    assert not (stale := sorted(set(listed) - want)), f"README's Layout lists what jaxrl/ does not hold: {stale}"
    assert len(listed) == len(set(listed)), "README's Layout lists a module twice"


def test_the_checks_catch_a_mistake(tmp_path):
    """The checks above can fail: a misspelt field, a missing config, an unknown flag or target, a broken
    link or anchor, a path that does not exist."""
    assert command_problems(shlex.split("jaxrl train configs/grpo_arithmetic.py --set train.steps=3")) == []
    assert "unknown field 'stepz'" in " ".join(
        command_problems(shlex.split("jaxrl train configs/grpo_arithmetic.py --set train.stepz=3"))
    )
    assert "does not exist" in " ".join(command_problems(shlex.split(".venv/bin/jaxrl train configs/nope.py")))
    assert "refuses" in " ".join(command_problems(shlex.split("jaxrl train configs/grpo_arithmetic.py --stepz 3")))
    assert "no such Makefile target" in " ".join(command_problems(["make", "trian"]))
    assert "unknown field" in " ".join(command_problems(["make", "train", "ARGS=--set rollout.groupsize=4"]))
    launch = "scripts/launch_slurm.sh --nodes 2 configs/grpo_arithmetic.py --set mesh.presett=data"
    assert "unknown field" in " ".join(command_problems(shlex.split(launch)))
    assert shell_commands("A=1 make train \\\n  CONFIG=x.py  # comment\nexport B=2\nx & y") == [
        ["make", "train", "CONFIG=x.py"],
        ["export", "B=2"],
        ["x"],
        ["y"],
    ]
    page = tmp_path / "page.md"
    page.write_text("# A title\n\n```python\n# not a heading\n```\n")
    assert link_problems(page, "[ok](page.md#a-title), [self](#a-title)") == []
    assert len(link_problems(page, "[gone](nope.md) [no heading](page.md#not-a-heading)")) == 2
    assert path_problems("see `jaxrl/train/loop.py` and configs/<preset>_arithmetic.py") == []
    assert path_problems("see `jaxrl/train/nope.py`.") == ["jaxrl/train/nope.py does not exist"]
    mine = "from jaxrl.config import Config\n\n\ndef get_config():\n    return Config()\n"
    page.write_text(f"<!-- docs-test: file my_config.py -->\n```python\n{mine}```\n")
    (saved := tmp_path / "saved").mkdir()
    files = page_files(page, saved)
    assert files == {"my_config.py": saved / "my_config.py"} and split_page(page)[0][0].file == "my_config.py"
    assert command_problems(shlex.split("jaxrl train my_config.py --set train.steps=3"), files) == []
    assert "unknown field" in " ".join(command_problems(shlex.split("jaxrl eval my_config.py --set x.y=1"), files))
    assert "does not exist" in " ".join(command_problems(shlex.split("jaxrl train my_config.py")))
