"""The repository describes itself for users and maintainers, not how it was made.

Every tracked text file (``git ls-files``; binary files, CHANGELOG.md and this file
excepted) is searched for words and paths that belong to a work log rather than to
the project: work sessions and their ordinals, device-time budgets, briefs, "the
seed" (the Rust original is named as mlx_native's ``flash_attn_train.rs``), paths
outside the repository, issue-tracker talk, work-in-progress branches and commit
hashes cited as history. Random seeds (``seed=``, ``PRNGKey(seed)``, ``--seed``)
are not flagged. Further tests check that links and backquoted repository paths in
Markdown files, and docs pages named anywhere, point at files that exist.
"""

from __future__ import annotations

import pathlib
import re
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
SELF = pathlib.Path(__file__).resolve().relative_to(ROOT).as_posix()
EXEMPT = {"CHANGELOG.md", SELF}

_ORDINALS = ("seventh|eighth|ninth|tenth|eleventh|twelfth|thirteenth|fourteenth|fifteenth|"
             "sixteenth|seventeenth|eighteenth|nineteenth|twentieth")

# (what it is, pattern); every pattern is matched case-insensitively, line by line.
FORBIDDEN = [
    ("a work session", r"\bsessions?\b"),
    ("an ordinal of a work period", rf"\b({_ORDINALS})\b"),
    ("an ordinal of a work period",
     r"\b(first|second|third|fourth|fifth|sixth|\d+(st|nd|rd|th))[- ]"
     r"(sitting|work period|period of work|round of work)s?\b"),
    ("a device-time budget", r"\bdevice[- ](time|budget)s?\b"),
    ("a brief", r"\bbriefs?\b"),
    ("'the seed' (name mlx_native's flash_attn_train.rs instead)",
     r"\bthe seed\b|\bseed's\b|(?<![a-z0-9])seed[ _-]?(pair|api|names?|layout|config|mask|backward|"
     r"forward|kernels?|original|abi|dispatcher)(?![a-z0-9])|\bseed/"),
    ("a path outside the repository", r"\.\./shared\b|(^|[\s`'\"(])shared/(seed|anchors|DESIGN|LAYOUT)"
     r"|\.library/|(^|[\s`'\"(=])/work/"),
    ("issue-tracker talk",
     r"\bissues?\s*#\s*\d+|\bgithub issues?\b|\bproduct[- ]shape\b"
     r"|\b(this|that|the|our|an) issue (asks|says|said|wants|requires|requested|describes|lists)\b"),
    ("a work-in-progress branch", r"(^|[\s`'\"(])wip/"),
    ("a lent machine", r"\bthe lent\b"),
    ("a notes file that no longer exists", r"\bPERF_NOTES\b"),
    ("a design file outside the repository (docs/design.md is the one here)",
     r"(?-i:(?<![/\w])(DESIGN|LAYOUT)\.md\b)"),
]
_COMPILED = [(what, re.compile(p, re.IGNORECASE)) for what, p in FORBIDDEN]

# A commit hash cited as history: 7 to 12 hex digits with at least one letter and
# one digit, not a 0x literal, after a word that introduces a revision.
_HEX = r"(?=[0-9a-f]*[a-f])(?=[0-9a-f]*[0-9])[0-9a-f]{7,12}"
_HASH = re.compile(
    rf"\b(commit|commits|fixed in|since|on|at|in|from|to|of|kernels of|head|see)\s+\(?{_HEX}\b"
    rf"|\({_HEX}\b|(?<![0-9a-z.]){_HEX}\)", re.IGNORECASE)


def _tracked_files() -> list[str]:
  if shutil.which("git") is None or not (ROOT / ".git").exists():
    pytest.skip("not a git checkout: the tracked files are unknown")
  out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, check=True,
                       capture_output=True).stdout
  return [p for p in out.decode().split("\0") if p]


def _text(path: pathlib.Path) -> str | None:
  """The file's text, or None for a binary or missing file."""
  try:
    data = path.read_bytes()
  except (FileNotFoundError, IsADirectoryError):
    return None
  if b"\0" in data[:8192]:
    return None
  try:
    return data.decode("utf-8")
  except UnicodeDecodeError:
    return None


def diary_findings(name: str, text: str) -> list[str]:
  """``file:line: what: the line`` for every forbidden word or path in ``text``."""
  found = []
  for number, line in enumerate(text.splitlines(), 1):
    hits = [what for what, pattern in _COMPILED if pattern.search(line)]
    if _HASH.search(line):
      hits.append("a commit hash cited as history")
    for what in dict.fromkeys(hits):
      found.append(f"{name}:{number}: {what}: {line.strip()[:120]}")
  return found


def test_tracked_files_speak_only_of_the_project():
  findings = []
  for name in _tracked_files():
    if name in EXEMPT:
      continue
    text = _text(ROOT / name)
    if text is not None:
      findings.extend(diary_findings(name, text))
  assert not findings, "work-log words or paths in tracked files:\n" + "\n".join(findings)


@pytest.mark.parametrize("line", [
    "see ../shared/seed/flash_attn_train.rs",
    "measured in the fifteenth session",
    "(PERF_NOTES, tenth)",
    "the seed's 160-byte params struct",
    "def test_seed_api_bnth_layout():",
    "with the last 90 s of device time",
    "as the brief says",
    "fixed in 41fa286",
    "Without this wait (fb7a737 to",
    "_split_seed_mask(mask)",
    "on the kernels of d4a57e8",
    "From `.library/device/KINDS.md`",
    "the product-shape issue",
    "branch `wip/bwd-bulk-dq`",
    "Conventions (DESIGN.md §4)",
])
def test_the_check_finds_work_log_words(line):
  assert diary_findings("x.md", line), line


@pytest.mark.parametrize("line", [
    "rng = np.random.default_rng(seed)",
    "key = jax.random.PRNGKey(seed)",
    "x = make_inputs(case, seed=7)",
    'p.add_argument("--seed", type=int, default=0)',
    "fully determined by the fixed seed below",
    "one lane issues one tensor reduction per box",
    "No branch may sit between the issue and the wait",
    "constexpr uint32_t kMask = 0x7fffffff;",
    "a SHA-256 of 3f5c2a9b0e1d4c6f8a7b9c0d1e2f3a4b5c6d7e8f9a0b1c2d3e4f5a6b7c8d9e0f",
    "mlx_native's `flash_attn_train.rs`",
    "one consumer per 64 keys at D = 128 (a third of the work)",
    "see docs/design.md and [the design](design.md)",
])
def test_the_check_leaves_ordinary_text_alone(line):
  assert not diary_findings("x.md", line), diary_findings("x.md", line)


_LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
# A repository path in backquotes, e.g. `cpp/cuda/launch.h` or `tools/` (not
# patterns such as `flash_attn_train_fwd_{bf16,f16}` or `tests/*.py`), from the
# repository root or from the Markdown file's folder.
_REPO_PATH = re.compile(r"`((?:cpp|jax_fatrain|tools|tests|docs|cmake|\.ci|\.github)/[^`\s]*)`")
# A docs page named anywhere, in any tracked file (comments and docstrings too).
_DOCS_PAGE = re.compile(r"(?<![\w/.])docs/[\w-]+\.md\b")


def test_markdown_links_and_paths_point_at_existing_files():
  broken = []
  for name in _tracked_files():
    if not name.endswith(".md") or name == "CHANGELOG.md":
      continue
    text = _text(ROOT / name) or ""
    for number, line in enumerate(text.splitlines(), 1):
      for target in _LINK.findall(line):
        if re.match(r"^[a-z]+:", target) or target.startswith("#"):
          continue  # a URL or an anchor in the same file
        path = target.split("#", 1)[0]
        if not (ROOT / name).parent.joinpath(path).resolve().exists():
          broken.append(f"{name}:{number}: link {target}")
      for path in _REPO_PATH.findall(line):
        if re.search(r"[{}*<>\[\]|]|\.\.\.", path):
          continue
        path = path.split(":", 1)[0]
        # From the repository root, or from the Markdown file's own folder.
        if not ((ROOT / path).exists() or (ROOT / name).parent.joinpath(path).exists()):
          broken.append(f"{name}:{number}: path {path}")
  assert not broken, "pointers to files that do not exist:\n" + "\n".join(broken)


def test_docs_pages_named_in_the_code_exist():
  missing = []
  for name in _tracked_files():
    text = _text(ROOT / name)
    if text is None or name in EXEMPT:
      continue
    for number, line in enumerate(text.splitlines(), 1):
      for page in _DOCS_PAGE.findall(line):
        if not (ROOT / page).exists():
          missing.append(f"{name}:{number}: {page}")
  assert not missing, "docs pages that do not exist:\n" + "\n".join(missing)
