"""Source rules the MSL emulator enforces where Apple's Metal compiler is stricter
than a C++ compiler, or where it silently does something expensive.

The emulator compiles .metal kernels as C++, which accepts code Apple's
compiler refuses. ``msl_prepass.py`` applies these rules to every .metal file
it translates, after the C preprocessor (macros expanded, the kernel's own
headers inlined; the Metal standard headers, which the emulator's shim
provides, are not part of the checked text), so a kernel that breaks one
cannot be built:

* ``unroll`` -- an array of thread memory (declared in a function body
  without an address space, ``simdgroup_matrix`` arrays included, or a
  member array of a struct used through a thread variable) indexed by a
  ``for`` loop's variable (or by a variable declared in the loop from it)
  inside that loop, when the loop is not immediately preceded by
  ``#pragma clang loop unroll(full)`` (``_Pragma("clang loop
  unroll(full)")`` in a macro such as MLX's ``STEEL_PRAGMA_UNROLL``
  expands to it). Apple's compiler keeps such an array in registers only
  when the loop is fully unrolled; otherwise it moves the array to the
  thread's stack in device memory.
* ``language`` -- constructs Metal does not have: ``throw`` / ``try`` /
  ``catch``, ``new`` / ``delete`` (``= delete`` is fine), ``virtual``,
  ``std::``, function pointers (a declarator or call of the form
  ``(*name)(...)``) and recursion (a function calling itself by its bare
  name with as many arguments as it takes; template functions calling
  another instantiation, ``f<N - 1>(...)``, are not recursion).

Each finding names the file and line (from the preprocessor's line markers),
the rule, and what was found. The rules are a small front end over the
preprocessed text, not a C++ parser; what they do not see is listed in
cpp/metal/emulator/README.md.
"""

from __future__ import annotations

import bisect
import os
import re
import subprocess
from dataclasses import dataclass

UNROLL_PRAGMA_RE = re.compile(r"#\s*pragma\s+clang\s+loop\s+unroll\s*\(\s*full\s*\)\s*$")
LINE_MARKER_RE = re.compile(r'#\s*(?:line\s+)?(\d+)\s+"((?:[^"\\]|\\.)*)"')
KEYWORDS = {"if", "for", "while", "switch", "return", "else", "do", "case", "goto", "sizeof",
            "alignof", "decltype", "static_assert", "using", "typedef", "new", "delete",
            "throw", "co_return", "operator", "template", "typename"}
ADDRESS_SPACES = {"device", "constant", "threadgroup", "threadgroup_imageblock", "ray_data",
                  "object_data"}


@dataclass
class Finding:
  file: str
  line: int
  rule: str
  message: str

  def __str__(self) -> str:
    return f"{self.file}:{self.line}: error: [{self.rule}] {self.message}"


class Source:
  """Preprocessed text with code-only masking and offset -> (file, line)."""

  def __init__(self, text: str):
    self.text = text
    # Offsets of line starts and each line's (file, line) from the markers.
    self.locations: list[tuple[str, int]] = []
    self.line_starts: list[int] = []
    file, line = "<input>", 1
    pos = 0
    for raw in text.split("\n"):
      self.line_starts.append(pos)
      m = LINE_MARKER_RE.match(raw.strip())
      self.locations.append((file, line))
      if m:
        file, line = m.group(2), int(m.group(1))
      else:
        line += 1
      pos += len(raw) + 1
    # Code with string/char literals and preprocessor lines blanked, so that
    # regexes match neither words in strings nor pragmas.
    self.code = _mask(text)

  def where(self, offset: int) -> tuple[str, int]:
    return self.locations[max(self.line_index(offset), 0)]

  def line_index(self, offset: int) -> int:
    return bisect.bisect_right(self.line_starts, offset) - 1


def _mask(text: str) -> str:
  out = []
  i, n = 0, len(text)
  at_line_start = True
  while i < n:
    c = text[i]
    if at_line_start and text[i:].lstrip(" \t").startswith("#"):
      j = text.find("\n", i)
      j = n if j < 0 else j
      out.append(" " * (j - i))
      i = j
      continue
    if c in "\"'":
      j = i + 1
      while j < n and text[j] != c and text[j] != "\n":
        j += 2 if text[j] == "\\" else 1
      out.append(c + " " * (min(j, n) - i - 1) + (c if j < n else ""))
      i = j + 1
      at_line_start = False
      continue
    if c == "/" and text.startswith("//", i):
      j = text.find("\n", i)
      j = n if j < 0 else j
      out.append(" " * (j - i))
      i = j
      continue
    if c == "/" and text.startswith("/*", i):
      j = text.find("*/", i + 2)
      j = n if j < 0 else j + 2
      out.append("".join(ch if ch == "\n" else " " for ch in text[i:j]))
      i = j
      continue
    out.append(c)
    at_line_start = c == "\n" or (at_line_start and c in " \t")
    i += 1
  return "".join(out)


def _match(code: str, start: int, open_c: str, close_c: str) -> int:
  depth = 0
  for i in range(start, len(code)):
    if code[i] == open_c:
      depth += 1
    elif code[i] == close_c:
      depth -= 1
      if depth == 0:
        return i
  return len(code) - 1


def _split_top(s: str, sep: str) -> list[str]:
  parts, depth, cur = [], 0, []
  for c in s:
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
    if c == sep and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(c)
  parts.append("".join(cur))
  return parts


FUNCTION_HEAD_RE = re.compile(
    r".*\)\s*((const|volatile|noexcept|override|final|thread|threadgroup|device|constant|&|&&)\s*)*"
    r"(->[^{};]*)?", re.S)


def function_bodies(code: str, classes: list | None = None):
  """(name, head, body_start, body_end, class_body) of functions defined at
  namespace or class scope (`{` at body_start, `}` at body_end; class_body is
  the (start, end) of the enclosing struct/class body or None). With
  ``classes``, the (start, end) of every struct/class body is appended to it."""
  out = []

  def walk(start: int, end: int, cls=None) -> None:
    i, head_start, parens = start, start, 0
    while i < end:
      c = code[i]
      if c in "([":
        parens += 1
      elif c in ")]":
        parens -= 1
      elif c == ";" and parens == 0:
        head_start = i + 1
      elif c == "{" and parens > 0:
        i = _match(code, i, "{", "}")
      elif c == "{":
        close = _match(code, i, "{", "}")
        head = code[head_start:i]
        h = " ".join(head.split())
        if re.match(r"(inline\s+)?namespace\b|extern\s+\"", h):
          walk(i + 1, close, cls)
        elif re.match(r"(template\s*<.*>\s*)?(struct|class|union)\b", h, re.S):
          if classes is not None:
            classes.append((i, close))
          walk(i + 1, close, (i, close))
        elif re.match(r"(template\s*<.*>\s*)?enum\b", h, re.S) or "=" in h.split("(")[0]:
          pass  # enum or braced initialiser
        elif FUNCTION_HEAD_RE.fullmatch(h):
          name = _function_name(h)
          if name:
            out.append((name, h, i, close, cls))
        i = close
        head_start = close + 1
      elif c == "}":
        head_start = i + 1
      i += 1

  walk(0, len(code))
  return out


NAME_CALL_RE = re.compile(r"(~?[A-Za-z_]\w*|operator\s*\S+?)\s*(<[^()]*>)?\s*\(")


def _function_name(head: str) -> str | None:
  """The declarator name of a function head `... name(params) quals`: the
  first name followed by `(` that is not a keyword or an attribute."""
  for m in NAME_CALL_RE.finditer(head):
    name = m.group(1)
    if name not in KEYWORDS and not name.startswith("__attribute"):
      return name
  return None


# ---------------------------------------------------------------------------
# Rule: unroll
# ---------------------------------------------------------------------------
ARRAY_DECL_RE = re.compile(
    r"(?:^|(?<=[;{}]))\s*((?:(?:const|volatile|thread|static|constexpr|constant|threadgroup|device|"
    r"typename)"
    r"\s+)*)"
    r"([A-Za-z_][\w:]*(?:\s*<[^;{}()]*?>)?(?:\s*::\s*\w+)*)\s+([A-Za-z_]\w*)\s*\[", re.M)


def _statement_end(code: str, i: int) -> int:
  """The offset just past the statement that starts at or after i."""
  n = len(code)
  while i < n and code[i].isspace():
    i += 1
  if i >= n:
    return n
  if code[i] == "{":
    return _match(code, i, "{", "}") + 1
  m = re.match(r"(for|while|if|switch)\b\s*\(", code[i:])
  if m:
    close = _match(code, i + m.end() - 1, "(", ")")
    end = _statement_end(code, close + 1)
    if m.group(1) == "if":
      e = re.match(r"\s*else\b", code[end:])
      if e:
        end = _statement_end(code, end + e.end())
    return end
  m = re.match(r"do\b", code[i:])
  if m:
    end = _statement_end(code, i + m.end())
    w = re.match(r"\s*while\s*\(", code[end:])
    if w:
      close = _match(code, end + w.end() - 1, "(", ")")
      semi = code.find(";", close)
      return semi + 1 if semi >= 0 else n
    return end
  depth = 0
  while i < n:
    c = code[i]
    if c in "([{":
      depth += 1
    elif c in ")]}":
      depth -= 1
      if depth < 0:
        return i
    elif c == ";" and depth == 0:
      return i + 1
    i += 1
  return n


def _loop_variables(header: str) -> set[str]:
  parts = _split_top(header, ";")
  names: set[str] = set()
  if len(parts) != 3:  # range-for or malformed: `for (auto x : xs)`
    m = re.search(r"([A-Za-z_]\w*)\s*:(?!:)", header)
    if m:
      names.add(m.group(1))
    return names
  init, _, step = parts
  for decl in _split_top(init, ","):
    m = re.search(r"([A-Za-z_]\w*)\s*(=|\{|\(|$)", decl.strip())
    if m and m.group(1) not in KEYWORDS:
      names.add(m.group(1))
  for m in re.finditer(r"([A-Za-z_]\w*)\s*(\+\+|--|[-+*/%&|^]?=(?!=)|<<=|>>=)|(\+\+|--)\s*"
                       r"([A-Za-z_]\w*)", step):
    names.add(m.group(1) or m.group(4))
  return names


def _subscripts(code: str, start: int) -> list[tuple[int, int]]:
  """The [..] groups that follow `start` (name[a][b]...)."""
  out = []
  i = start
  while True:
    m = re.match(r"\s*\[", code[i:])
    if not m:
      return out
    open_i = i + m.end() - 1
    close = _match(code, open_i, "[", "]")
    out.append((open_i + 1, close))
    i = close + 1


def _array_declarations(text: str, offset: int) -> dict[str, int]:
  """Thread-memory arrays declared in ``text`` (a function or class body
  starting at ``offset`` in the code): name -> offset of the name."""
  arrays: dict[str, int] = {}
  for m in ARRAY_DECL_RE.finditer(text):
    quals = set(m.group(1).split())
    type_name = m.group(2).split("<")[0].strip()
    if quals & (ADDRESS_SPACES | {"static", "constexpr"}) or type_name in KEYWORDS:
      continue
    # `T x[N]` followed by `;`, `=`, `{` or `,` is a declaration; further
    # declarators (`T a[N], b[M];`) are arrays of the same type.
    name, name_at, sub_at = m.group(3), m.start(3), m.end() - 1
    while True:
      subs = _subscripts(text, sub_at)
      rest = text[subs[-1][1] + 1:] if subs else ""
      after = rest.lstrip()[:1]
      if after not in (";", "=", "{", ","):
        break
      arrays.setdefault(name, offset + name_at)
      nxt = re.match(r"\s*,\s*([A-Za-z_]\w*)\s*\[", rest)
      if not nxt:
        break
      base = subs[-1][1] + 1
      name, name_at, sub_at = nxt.group(1), base + nxt.start(1), base + nxt.end() - 1
  return arrays


def _blank_blocks(text: str) -> str:
  """``text`` with every {...} block blanked (a class body's own scope)."""
  out, depth = [], 0
  for c in text:
    if c == "{":
      depth += 1
    out.append(c if depth == 0 or c == "\n" else " ")
    if c == "}":
      depth -= 1
  return "".join(out)


def check_unroll(src: Source) -> list[Finding]:
  code = src.code
  findings = []
  classes: list[tuple[int, int]] = []
  functions = function_bodies(code, classes)
  # Member arrays of structs and classes: per class, and by member name for
  # accesses `x.m[i]` / `p->m[i]` through a thread variable.
  class_arrays = {c: _array_declarations(_blank_blocks(code[c[0] + 1:c[1]]), c[0] + 1)
                  for c in classes}
  members: dict[str, int] = {}
  for arrs in class_arrays.values():
    for k, v in arrs.items():
      members.setdefault(k, v)
  for _, head, body_start, body_end, cls in functions:
    body = code[body_start + 1:body_end]
    # Arrays this body can index by name: its own, then its class's members.
    arrays = _array_declarations(body, body_start + 1)
    for k, v in (class_arrays.get(cls) or {}).items():
      arrays.setdefault(k, v)
    parts = []
    if arrays:
      parts.append(r"(?<![\w.>:])(?P<name>" + "|".join(map(re.escape, arrays)) + r")\s*\[")
    if members:
      parts.append(r"(?<![\w.>:])(?P<base>[A-Za-z_]\w*)\s*(?:\.|->)\s*(?P<member>" +
                   "|".join(map(re.escape, members)) + r")\s*\[")
    if not parts:
      continue
    names_re = re.compile("|".join(parts))
    # Variables of another address space (their members are not registers).
    other_space = set(re.findall(
        r"\b(?:device|constant|threadgroup)\b[^;{}()]*?[\s*&]([A-Za-z_]\w*)\s*(?=[,;)=\[])",
        head + body))
    for fm in re.finditer(r"\bfor\s*\(", body):
      for_at = body_start + 1 + fm.start()
      if _preceded_by_unroll(src, for_at):
        continue
      open_p = for_at + fm.end() - fm.start() - 1
      close_p = _match(code, open_p, "(", ")")
      loop_vars = _loop_variables(code[open_p + 1:close_p])
      if not loop_vars:
        continue
      loop_end = _statement_end(code, close_p + 1)
      loop_text = code[close_p + 1:loop_end]
      # Variables declared in the loop from a loop variable index as it does.
      changed = True
      while changed:
        changed = False
        var_re = re.compile(r"\b(" + "|".join(map(re.escape, loop_vars)) + r")\b")
        for dm in re.finditer(r"\b([A-Za-z_]\w*)\s*=(?!=)\s*([^;,{}]*)", loop_text):
          if dm.group(1) not in loop_vars and var_re.search(dm.group(2)) and \
             re.search(r"[\w>]\s+$", loop_text[:dm.start(1)]):
            loop_vars.add(dm.group(1))
            changed = True
      var_re = re.compile(r"\b(" + "|".join(map(re.escape, sorted(loop_vars))) + r")\b")
      reported = set()
      for am in names_re.finditer(loop_text):
        if am.group("name") if arrays else False:
          name, decl = am.group("name"), arrays[am.group("name")]
        else:
          if am.group("base") in other_space:
            continue
          name = f"{am.group('base')}.{am.group('member')}"
          decl = members[am.group("member")]
        at = close_p + 1 + am.start()
        if name in reported or (decl > for_at and decl < body_end):
          continue
        for a, b in _subscripts(code, close_p + 1 + am.end() - 1):
          vm = var_re.search(code[a:b])
          if vm:
            file, line = src.where(for_at)
            _, aline = src.where(at)
            decl_file, decl_line = src.where(decl)
            header = " ".join(code[for_at:close_p + 1].split())
            findings.append(Finding(
                file, line, "unroll",
                f"loop `{header}` indexes the thread-memory array `{name}` (declared at "
                f"{decl_file}:{decl_line}) by `{vm.group(1)}` at line {aline} but is not "
                f"preceded by `#pragma clang loop unroll(full)`: Metal would move `{name}` "
                f"to the stack in device memory"))
            reported.add(name)
            break
  return findings


def _preceded_by_unroll(src: Source, offset: int) -> bool:
  """Whether the code before `offset` (skipping blanks and line markers) ends
  with a `#pragma clang loop unroll(full)` line."""
  line = src.line_index(offset)
  # Code on the `for`'s own line before it must be blank.
  if src.code[src.line_starts[line]:offset].strip():
    return False
  line -= 1
  while line >= 0:
    raw = src.text[src.line_starts[line]:src.line_starts[line + 1] - 1] \
        if line + 1 < len(src.line_starts) else src.text[src.line_starts[line]:]
    stripped = raw.strip()
    if not stripped or LINE_MARKER_RE.match(stripped):
      line -= 1
      continue
    return bool(UNROLL_PRAGMA_RE.match(stripped))
  return False


# ---------------------------------------------------------------------------
# Rule: language
# ---------------------------------------------------------------------------
LANGUAGE_RES = [
    (re.compile(r"\bthrow\b"), "`throw`: Metal has no exceptions"),
    (re.compile(r"\btry\b"), "`try`: Metal has no exceptions"),
    (re.compile(r"\bcatch\s*\("), "`catch`: Metal has no exceptions"),
    (re.compile(r"\bnew\b"), "`new`: Metal has no dynamic allocation"),
    (re.compile(r"\bdelete\b"), "`delete`: Metal has no dynamic allocation"),
    (re.compile(r"\bvirtual\b"), "`virtual`: Metal has no virtual functions"),
    (re.compile(r"\bstd\s*::"), "`std::`: Metal has no C++ standard library (use metal::)"),
    (re.compile(r"\(\s*(?:[A-Za-z_]\w*\s*::\s*)*\*\s*(?:const\s+)?[A-Za-z_]?\w*\s*\)\s*\("),
     "function pointer: Metal kernels cannot declare or call through function pointers"),
]


def check_language(src: Source) -> list[Finding]:
  code = src.code
  findings = []
  for pattern, what in LANGUAGE_RES:
    for m in pattern.finditer(code):
      if "delete" in what and re.search(r"=\s*$", code[:m.start()][-20:]):
        continue  # `= delete`
      file, line = src.where(m.start())
      findings.append(Finding(file, line, "language", what))
  # Direct recursion: a function calling itself by its bare name with its
  # arity. Without types a call cannot be told from a call of an overload, so
  # only names defined once in the text and not also a Metal library function
  # (the shim's) are checked.
  functions = function_bodies(code)
  defined = {}
  for name, _, _, _, _ in functions:
    defined[name] = defined.get(name, 0) + 1
  library = _library_function_names()
  for name, head, body_start, body_end, _ in functions:
    if name.startswith(("~", "operator")) or defined[name] > 1 or name in library:
      continue
    params = _params_of(head, name)
    if params is None:
      continue
    lo = sum(1 for p in params if "=" not in p)
    hi = len(params)
    body = code[body_start:body_end]
    for m in re.finditer(r"(?<![\w.>:~])" + re.escape(name) + r"\s*\(", body):
      args_open = body_start + m.end() - 1
      close = _match(code, args_open, "(", ")")
      inner = code[args_open + 1:close]
      n_args = 0 if not inner.strip() else len(_split_top(inner, ","))
      # `name(...)` right after a type word is a declaration, not a call.
      before = code[:body_start + m.start()].rstrip()
      if re.search(r"\b(struct|class|typename|new)$", before):
        continue
      if lo <= n_args <= hi:
        file, line = src.where(body_start + m.start())
        findings.append(Finding(file, line, "language",
                                f"recursion: `{name}` calls itself; Metal has no call stack "
                                f"for recursive functions"))
        break
  return findings


_LIBRARY_NAMES: set[str] | None = None


def _library_function_names() -> set[str]:
  """Names the emulator's shim (include/) declares as functions: a kernel's
  unqualified call of one may resolve to the library, not to itself."""
  global _LIBRARY_NAMES
  if _LIBRARY_NAMES is None:
    names: set[str] = set()
    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")
    for d, _, files in os.walk(root):
      for f in files:
        with open(os.path.join(d, f), encoding="utf-8") as fh:
          names.update(re.findall(r"\b([A-Za-z_]\w*)\s*\(", fh.read()))
    _LIBRARY_NAMES = names
  return _LIBRARY_NAMES


def _params_of(head: str, name: str) -> list[str] | None:
  m = re.search(re.escape(name) + r"\s*(<[^()]*>)?\s*\(", head)
  if not m:
    return None
  close = _match(head, m.end() - 1, "(", ")")
  inner = head[m.end():close].strip()
  if not inner or inner == "void":
    return []
  return _split_top(inner, ",")


RULES = {"unroll": check_unroll, "language": check_language}


def check(text: str, rules=("unroll", "language")) -> list[Finding]:
  """Findings of the given rules over preprocessed source ``text``."""
  src = Source(text)
  out: list[Finding] = []
  for r in rules:
    out.extend(RULES[r](src))
  out.sort(key=lambda f: (f.file, f.line, f.rule))
  return out


# ---------------------------------------------------------------------------
# Rule: address-space (clang)
# ---------------------------------------------------------------------------
# clang's spellings of the attributes include/metal_stdlib gives the MSL
# address spaces under MSL_EMU_ADDRESS_SPACES, and the MSL words for them.
CLANG_ADDRESS_SPACES = {"__global_device": "device", "__global_host": "constant",
                        "__local": "threadgroup", "__private": "thread"}
DIAGNOSTIC_RE = re.compile(r"^(.*?):(\d+):(\d+): (error|warning|note): (.*)$")


def clang_address_space_flags(include_dir: str) -> list[str]:
  # SYCL device mode: clang's address spaces whose pointers and references
  # convert to unqualified ones (as a Metal value can be copied out of any
  # address space) but never to one another.
  return ["-x", "c++", "-std=c++17", "-fsyntax-only", "-Xclang", "-fsycl-is-device", "-mavx512fp16", "-w",
          "-fno-caret-diagnostics", "-ferror-limit=0", "-DMSL_EMU_ADDRESS_SPACES",
          "-I", include_dir]


class ClangUnusable(Exception):
  """This clang++ cannot run the address-space check (too old, or it does not
  keep the address spaces apart); the message says why."""


# Appended to the checked text: fails when the address spaces are not kept
# apart (e.g. a clang that ignores the attributes).
SELF_CHECK = ("\nstatic_assert(!__is_convertible_to(threadgroup float*, device float*) && "
              "!__is_convertible_to(constant float*, const device float*), "
              "\"msl_emu_address_spaces_not_distinct\");\n")


def _run_clang(text: str, clang: str, include_dir: str):
  try:
    return subprocess.run([clang] + clang_address_space_flags(include_dir) + ["-"],
                          input="#include <metal_stdlib>\n" + text + SELF_CHECK,
                          capture_output=True, text=True)
  except OSError as e:
    raise ClangUnusable(f"{clang}: {e}") from e


def check_address_spaces(code: str, clang: str, include_dir: str) -> list[Finding]:
  """Findings of clang -fsyntax-only over ``code`` (msl_prepass.transform's
  address-space text, instantiations appended), in which device, constant,
  threadgroup and thread are distinct address spaces. Raises ClangUnusable
  when ``clang`` cannot do this check at all."""
  proc = _run_clang(code, clang, include_dir)
  if proc.returncode == 0:
    return []
  out = proc.stderr
  if "msl_emu_address_spaces_not_distinct" in out:
    raise ClangUnusable(f"{clang} does not keep MSL address spaces apart")
  for k, v in CLANG_ADDRESS_SPACES.items():
    out = re.sub(rf"\b{k}\b", v, out)
  # Group each error with its notes; keep the errors that concern address spaces.
  groups: list[list[re.Match]] = []
  for ln in out.splitlines():
    m = DIAGNOSTIC_RE.match(ln)
    if not m:
      continue
    if m.group(4) == "error" or not groups:
      groups.append([m])
    else:
      groups[-1].append(m)
  findings = []
  space_words = re.compile(r"address space|\b(device|constant|threadgroup)\b")
  for g in groups:
    head = g[0]
    if head.group(4) != "error":
      continue
    text = "\n".join(x.group(5) for x in g)
    if not space_words.search(text):
      continue
    detail = head.group(5)
    notes = [f"{x.group(1)}:{x.group(2)}: {x.group(5)}" for x in g[1:]
             if space_words.search(x.group(5))]
    if notes:
      detail += " (" + "; ".join(notes[:3]) + ")"
    findings.append(Finding(head.group(1), int(head.group(2)), "address-space", detail))
  if not findings:
    # clang refused the code for another reason. If it cannot compile the
    # shim alone, this clang cannot run the check; otherwise say what it
    # refused rather than pass the kernel.
    probe = _run_clang("", clang, include_dir)
    if probe.returncode != 0:
      raise ClangUnusable(f"{clang} cannot compile the emulator's shim in this mode: " +
                          " ".join(probe.stderr.strip().splitlines()[:2]))
    errors = [ln for ln in out.splitlines() if ": error: " in ln][:5]
    findings.append(Finding("<clang>", 0, "address-space",
                            "the address-space check could not compile the kernel:\n  " +
                            "\n  ".join(errors or out.splitlines()[-5:])))
  return findings
