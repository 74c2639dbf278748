#!/usr/bin/env python3
"""MSL emulator front end: turns an unmodified .metal file into C++.

The C++ compiler cannot read MSL attributes (``[[buffer(0)]]``,
``[[threadgroup_position_in_grid]]``, ...) and MSL's address spaces mean
something C++ has no word for. This pre-pass

* runs the C preprocessor over the source first (local includes from the
  file's directory and the ``-I`` roots, macros such as instantiation lists;
  the Metal standard headers are left to the shim),
* records every ``[[kernel]]`` function's parameters and their attributes
  (also ``[[kernel, max_total_threads_per_threadgroup(N)]]`` or the separate
  ``[[max_total_threads_per_threadgroup(N)]]``: N, which may depend on
  template parameters, is evaluated per instantiation as a constexpr and the
  runtime refuses dispatches with larger threadgroups),
* enforces the rules of ``msl_rules.py`` (loop unrolling of register arrays,
  no exceptions / new / virtual / std:: / function pointers / recursion, and
  with ``--clang`` distinct address spaces); a kernel that breaks one is
  not translated,
* records every ``[[host_name("...")]]`` instantiation and every
  ``[[function_constant(N)]]`` declaration,
* rewrites ``device``/``constant`` pointers into bounds-checked ``msl::rt::dptr``,
  ``threadgroup`` declarations into per-threadgroup arena variables of tracked
  elements (``msl::rt::tgelem``; threadgroup pointers and references likewise)
  and function constants into thread-local variables set per dispatch,
* removes the attributes, also those on helper-function parameters such as
  ``[[threadgroup(0)]]`` (the preprocessor's line markers keep compiler errors
  pointing at the right line of the .metal file),
* turns MSL literal suffixes (``1.0h``, ``1.0bf``) into casts,
* drops overloads that differ only by address space (they collide once the
  address spaces vanish; see remove_address_space_duplicates), and
* appends glue that binds buffers/builtins to parameters and registers each
  instantiated kernel under its host name with the emulator runtime
  (``--kernels`` limits that to some host names, so only their templates are
  instantiated).

Usage: msl_prepass.py INPUT.metal OUTPUT.cc [--cxx COMPILER] [-I DIR ...]
                      [--kernels NAME,...] [--clang CLANGXX] [--skip-rule RULE ...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import msl_rules  # noqa: E402  (this directory)

BUILTINS = {
    "threadgroup_position_in_grid": "kThreadgroupPositionInGrid",
    "thread_position_in_threadgroup": "kThreadPositionInThreadgroup",
    "thread_position_in_grid": "kThreadPositionInGrid",
    "threads_per_threadgroup": "kThreadsPerThreadgroup",
    "threadgroups_per_grid": "kThreadgroupsPerGrid",
    "threads_per_grid": "kThreadsPerGrid",
    "thread_index_in_threadgroup": "kThreadIndexInThreadgroup",
    "thread_index_in_simdgroup": "kThreadIndexInSimdgroup",
    "simdgroup_index_in_threadgroup": "kSimdgroupIndexInThreadgroup",
    "threads_per_simdgroup": "kThreadsPerSimdgroup",
    "simdgroups_per_threadgroup": "kSimdgroupsPerThreadgroup",
}


class PrepassError(Exception):
  pass


@dataclass
class Param:
  decl: str          # declaration without attributes
  name: str
  kind: str          # buffer | builtin | threadgroup
  index: str         # buffer index, builtin enum name, threadgroup index
  guard: str | None  # function constant name guarding an optional buffer


@dataclass
class Kernel:
  name: str
  params: list[Param] = field(default_factory=list)
  body: str = ""
  is_template: bool = False
  template_params: str = ""      # text inside `template <...>`
  max_threads: str | None = None  # max_total_threads_per_threadgroup expression


def blank_comments(src: str) -> str:
  """Replaces comments by spaces (newlines kept) so regexes never match in them."""
  out = []
  i, n = 0, len(src)
  while i < n:
    if src.startswith("//", i):
      j = src.find("\n", i)
      j = n if j < 0 else j
      out.append(" " * (j - i))
      i = j
    elif src.startswith("/*", i):
      j = src.find("*/", i + 2)
      j = n if j < 0 else j + 2
      out.append("".join(c if c == "\n" else " " for c in src[i:j]))
      i = j
    elif src[i] == '"':
      j = i + 1
      while j < n and src[j] != '"':
        j += 2 if src[j] == "\\" else 1
      out.append(src[i:j + 1])
      i = j + 1
    else:
      out.append(src[i])
      i += 1
  return "".join(out)


def match_close(s: str, start: int, open_c: str, close_c: str) -> int:
  depth = 0
  for i in range(start, len(s)):
    if s[i] == open_c:
      depth += 1
    elif s[i] == close_c:
      depth -= 1
      if depth == 0:
        return i
  raise PrepassError(f"unbalanced {open_c}{close_c} at offset {start}")


def split_top_level(s: str) -> list[str]:
  parts, depth, cur = [], 0, []
  for c in s:
    if c in "([<":
      depth += 1
    elif c in ")]>":
      depth -= 1
    if c == "," and depth == 0:
      parts.append("".join(cur))
      cur = []
    else:
      cur.append(c)
  if "".join(cur).strip():
    parts.append("".join(cur))
  return parts


ATTR_RE = re.compile(r"\[\[(.*?)\]\]", re.S)


def parse_param(text: str, kernel: str) -> tuple[Param, str]:
  """Returns the parameter and its text with the attribute removed."""
  m = ATTR_RE.search(text)
  if not m:
    raise PrepassError(f"kernel {kernel}: parameter without attribute: {text.strip()!r}")
  attrs = [a.strip() for a in split_top_level(m.group(1))]
  stripped = text[:m.start()] + " " * 0 + text[m.end():]
  decl = stripped.strip()
  name_m = re.search(r"(\w+)\s*$", decl)
  if not name_m:
    raise PrepassError(f"kernel {kernel}: cannot find the parameter name in {decl!r}")
  name = name_m.group(1)
  kind = index = guard = None
  for a in attrs:
    if (b := re.fullmatch(r"buffer\(\s*(\d+)\s*\)", a)):
      kind, index = "buffer", b.group(1)
    elif (b := re.fullmatch(r"threadgroup\(\s*(\d+)\s*\)", a)):
      kind, index = "threadgroup", b.group(1)
    elif (b := re.fullmatch(r"function_constant\(\s*(\w+)\s*\)", a)):
      guard = b.group(1)
    elif a in BUILTINS:
      kind, index = "builtin", BUILTINS[a]
    else:
      raise PrepassError(f"kernel {kernel}: unsupported parameter attribute [[{a}]]")
  if kind is None:
    raise PrepassError(f"kernel {kernel}: parameter {name} has no binding attribute")
  return Param(decl, name, kind, index, guard), stripped


MSL_ATTRIBUTE_RE = re.compile(
    r"(" + "|".join(BUILTINS) + r"|kernel|host_name\(.*\)|"
    r"(buffer|threadgroup|texture|sampler|function_constant|"
    r"max_total_threads_per_threadgroup|user|attribute|color)\(.*\))", re.S)


def is_msl_attribute(text: str) -> bool:
  """Whether every item of an attribute list `[[text]]` is an MSL attribute."""
  items = [a.strip() for a in split_top_level(text)]
  return bool(items) and all(MSL_ATTRIBUTE_RE.fullmatch(a) for a in items)


LITERAL_RE = re.compile(r"(?<![\w.])((?:\d+\.\d*|\.\d+|\d+)(?:[eE][+-]?\d+)?)(h|H|bf|BF)\b")

# MSL address-space words; in the emulator they vanish (macros in the shim).
ADDRESS_SPACE_RE = re.compile(
    r"\b(thread|threadgroup|device|constant|threadgroup_imageblock|ray_data|object_data)\b")
FUNCTION_HEAD_RE = re.compile(
    r".*\)\s*((const|volatile|noexcept|override|final|&|&&)\s*)*(->[^{};]*)?", re.S)


def _normalise(head: str, keep_address_spaces: bool = False) -> str:
  lines = [ln for ln in head.split("\n") if not ln.lstrip().startswith("#")]
  text = " ".join(lines)
  if not keep_address_spaces:
    text = ADDRESS_SPACE_RE.sub(" ", text)
  text = re.sub(r"^\s*(public|private|protected)\s*:", " ", text)
  return " ".join(text.split())


def remove_address_space_duplicates(code: str, keep_address_spaces: bool = False) -> str:
  """Drops definitions that become duplicates once address spaces vanish.

  MSL overloads functions and partial specialisations on address spaces
  (`f(thread T*)` / `f(threadgroup T*)`, member functions qualified `thread` /
  `device` / `constant`, `pointer_element<thread T*>` / `<threadgroup T*>`).
  In the emulator every address space is ordinary memory, so such a set
  collapses to one definition: the first is kept, later ones whose signature
  is the same after removing the address-space words (in the same namespace
  or class) are blanked (line breaks and line markers kept). Function bodies
  are not searched: only namespace and class scopes. With
  ``keep_address_spaces`` (the address-space check's text) only exact
  duplicates are dropped.
  """
  removals: list[tuple[int, int]] = []

  def skip_literal(i: int) -> int:
    q = code[i]
    j = i + 1
    while j < len(code) and code[j] != q:
      j += 2 if code[j] == "\\" else 1
    return j

  def walk(start: int, end: int, scope: tuple, is_class: bool, seen: set) -> None:
    i, head_start, parens = start, start, 0
    while i < end:
      c = code[i]
      if c in "\"'":
        i = skip_literal(i)
      elif c in "([":
        parens += 1
      elif c in ")]":
        parens -= 1
      elif c == ";" and parens == 0:
        stmt = _normalise(code[head_start:i], keep_address_spaces)
        # A member function declared twice (differing only by address space).
        if is_class and FUNCTION_HEAD_RE.fullmatch(stmt) and "=" not in stmt:
          key = (scope, stmt)
          if key in seen:
            removals.append((head_start, i + 1))
          seen.add(key)
        head_start = i + 1
      elif c == "{" and parens > 0:
        i = match_close(code, i, "{", "}")  # a braced initialiser in a parameter list
      elif c == "{":
        close = match_close(code, i, "{", "}")
        head = _normalise(code[head_start:i], keep_address_spaces)
        if re.match(r"(inline\s+)?namespace\b|extern\s+\"C", head):
          walk(i + 1, close, scope + (head,), False, seen)
        elif re.match(r"(template\s*<.*>\s*)?(struct|class|union)\b", head, re.S):
          stop = code.find(";", close)
          key = (scope, head)
          if key in seen and re.fullmatch(r"\s*", code[close + 1:stop]):
            removals.append((head_start, stop + 1))
          else:
            seen.add(key)
            walk(i + 1, close, scope + (head,), True, seen)
        elif FUNCTION_HEAD_RE.fullmatch(head) and not head.startswith(("if", "for", "while",
                                                                        "switch")):
          key = (scope, head)
          if key in seen:
            removals.append((head_start, close + 1))
          seen.add(key)
        i = close
        head_start = close + 1
      elif c == "}":
        head_start = i + 1
      i += 1

  walk(0, len(code), (), False, set())
  if not removals:
    return code
  out, pos = [], 0
  for a, b in sorted(removals):
    if a < pos:
      continue
    out.append(code[pos:a])
    out.append("\n".join(ln if ln.lstrip().startswith("#") else ""
                         for ln in code[a:b].split("\n")))
    pos = b
  out.append(code[pos:])
  return "".join(out)


# Metal standard headers: the shim (include/metal_stdlib) provides all of them
# when the generated C++ is compiled, so the preprocessing pass sees them empty.
METAL_HEADERS = ("metal_stdlib", "metal_simdgroup", "metal_simdgroup_matrix", "metal_math",
                 "metal_compute", "metal_atomic", "metal_integer", "metal_common",
                 "metal_geometric", "metal_relational", "metal_types", "metal_numeric",
                 "metal_pack", "metal_texture", "metal_matrix")


def preprocess(path: str, cxx: str, include_dirs: list[str]) -> str:
  """The source after the C preprocessor (macros expanded, local includes inlined)."""
  with tempfile.TemporaryDirectory() as stubs:
    for name in METAL_HEADERS:
      with open(os.path.join(stubs, name), "w") as f:
        f.write("#pragma once\n")
    # -undef: no compiler- or platform-specific macros (e.g. `linux`); the
    # kernels see __METAL_VERSION__ as under Apple's compiler (Metal 3.1).
    cmd = [cxx, "-E", "-x", "c++", "-std=c++17", "-undef", "-nostdinc",
           "-D__METAL_VERSION__=310", "-isystem", stubs]
    for d in [os.path.dirname(os.path.abspath(path))] + include_dirs:
      cmd += ["-I", d]
    cmd.append(path)
    proc = subprocess.run(cmd, capture_output=True, text=True)
  if proc.returncode != 0:
    raise PrepassError(f"preprocessing {path} failed:\n{proc.stderr}")
  # The stub directory is temporary: name it the same every time, so that the
  # output depends only on the input.
  return proc.stdout.replace(stubs, "<metal-headers>")


def transform(src: str, path: str, address_spaces: bool = False):
  """``src`` is the preprocessed source of ``path``.

  With ``address_spaces`` the result is the text the address-space check
  compiles (msl_rules.check_address_spaces): address-space qualifiers stay
  (the shim makes them clang address spaces), threadgroup variables become
  function-local statics of that address space, and instead of the binding
  glue every instantiation is named once (so that clang checks its body).
  """
  code = blank_comments(src)
  constants: dict[str, tuple[str, int]] = {}   # name -> (type, index)
  instantiations: list[tuple[str, str, str]] = []
  kernels: dict[str, Kernel] = {}

  def same_lines(text: str, replacement: str) -> str:
    return replacement + "\n" * (text.count("\n") - replacement.count("\n"))

  # Function constants.
  def fc_sub(m):
    ctype, name, idx = m.group(1), m.group(2), int(m.group(3))
    constants[name] = (ctype, idx)
    if address_spaces:
      return same_lines(m.group(0), f"static {ctype} {name};")
    return same_lines(m.group(0), f"static thread_local {ctype} {name};")
  code = re.sub(r"\bconstant\s+(\w+)\s+(\w+)\s*\[\[\s*function_constant\(\s*(\d+)\s*\)\s*\]\]\s*;",
                fc_sub, code)

  # Instantiations.
  inst_re = re.compile(
      r"template\s*\[\[\s*host_name\(\s*((?:\"\w*\"\s*)+)\)\s*\]\]\s*\[\[\s*kernel\s*\]\]\s*"
      r"decltype\(\s*(\w+)\s*<([^;]*?)>\s*\)\s*\w+\s*<[^;]*?>\s*;", re.S)

  def inst_sub(m):
    host = "".join(re.findall(r'"(\w*)"', m.group(1)))  # adjacent literals concatenate
    instantiations.append((host, m.group(2), " ".join(m.group(3).split())))
    return same_lines(m.group(0), "")
  code = inst_re.sub(inst_sub, code)

  # Kernel definitions: `[[kernel]]` or an attribute list that contains it,
  # e.g. `[[kernel, max_total_threads_per_threadgroup(N)]]`.
  out, pos = [], 0
  # The attributes may also be separate lists: `[[kernel]]
  # [[max_total_threads_per_threadgroup(N)]]`.
  for m in re.finditer(r"((?:\[\[[^\[\]]*\]\]\s*)+)void\s+(\w+)\s*\(", code):
    attrs = [a.strip() for group in re.findall(r"\[\[([^\[\]]*)\]\]", m.group(1))
             for a in split_top_level(group)]
    if "kernel" not in attrs:
      continue
    name = m.group(2)
    open_paren = m.end() - 1
    close_paren = match_close(code, open_paren, "(", ")")
    kernel = Kernel(name)
    new_params = []
    for ptext in split_top_level(code[open_paren + 1:close_paren]):
      param, stripped = parse_param(ptext, name)
      kernel.params.append(param)
      new_params.append(stripped)
    brace = code.index("{", close_paren)
    end = match_close(code, brace, "{", "}")
    kernel.body = code[brace:end + 1]
    # A template kernel: `template <...>` is all that precedes the attribute
    # since the previous declaration ended.
    prev_end = max(code.rfind(c, 0, m.start()) for c in ";{}")
    preceding = re.sub(r"(?m)^\s*#.*$", "", code[prev_end + 1:m.start()])  # line markers
    tmpl = re.fullmatch(r"\s*template\s*<(.*)>\s*", preceding, re.S)
    kernel.is_template = tmpl is not None
    kernel.template_params = tmpl.group(1) if tmpl else ""
    for a in attrs:
      if (b := re.fullmatch(r"max_total_threads_per_threadgroup\((.*)\)", a, re.S)):
        kernel.max_threads = b.group(1).strip()
      elif a != "kernel":
        raise PrepassError(f"kernel {name}: unsupported kernel attribute [[{a}]]")
    kernels[name] = kernel
    head = re.sub(r"[^\n]", " ", m.group(1)) + code[m.end(1):m.end() - 1]
    out.append(code[pos:m.start()])
    out.append(head + "(" + ",".join(new_params) + ")")
    out.append(code[close_paren + 1:end + 1])
    if kernel.max_threads is not None:
      # The attribute's bound as a function of the kernel's template
      # parameters, evaluated per instantiation by the glue (same line).
      tmpl_head = f"template <{kernel.template_params}> " if kernel.is_template else ""
      out.append(" " + " ".join(f"{tmpl_head}constexpr unsigned long msl_emu_max_threads_{name}() "
                                f"{{ return ({kernel.max_threads}); }}".split()))
    pos = end + 1
  out.append(code[pos:])
  code = "".join(out)

  if address_spaces:
    # Attributes and literal suffixes as below; nothing else changes.
    code = ATTR_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)) if is_msl_attribute(m.group(1))
                       else m.group(0), code)
    code = LITERAL_RE.sub(
        lambda m: f"static_cast<{'half' if m.group(2) in 'hH' else 'bfloat'}>({m.group(1)})",
        code)
    code = re.sub(rf"\bthreadgroup\s+({TYPE_RE})\s+(\w+)\s*((?:\[[^\]]+\]\s*)*);",
                  lambda m: "static " + m.group(0), code)
    # clang has no address-space-qualified member functions: `f() const
    # threadgroup` / `f() const thread` overloads collapse to one.
    code = re.sub(r"\)(\s*(?:const\s+)?)(?:thread|threadgroup|device|constant)\b(?=\s*(?:const\s*)?"
                  r"(?:\{|;|=|:(?!:)))", r")\1", code)
    # Array parameters of an address space are the pointers they decay to.
    code = re.sub(rf"\b(constant|device|threadgroup)\s+((?:const\s+)?{TYPE_RE})\s+(\w+)\s*"
                  r"\[[^\]]*\](?=\s*[,)])", r"\1 \2* \3", code)
    code = remove_address_space_duplicates(code, keep_address_spaces=True)
    for name, k in kernels.items():
      if not k.is_template:
        instantiations.append((name, name, None))
    return code, constants, instantiations, kernels

  code = rewrite_threadgroup(code)
  # device / constant pointers -> checked pointers.
  ptr_re = re.compile(
      r"(\bconst\s+)?\b(device|constant)\s+(const\s+)?([A-Za-z_][\w:]*(?:\s*<[^;<>()]*>)?)\s*\*")

  def ptr_sub(m):
    is_const = bool(m.group(1) or m.group(3)) or m.group(2) == "constant"
    t = m.group(4)
    if t == "auto":  # `constant auto* p = q;` deduces q's checked pointer type
      return "auto "
    return f"::msl::rt::dptr<{'const ' if is_const else ''}{t}> "
  code = ptr_re.sub(ptr_sub, code)
  code = re.sub(r"(\bconst\s+)?\bconstant\s+(const\s+)?([A-Za-z_][\w:]*)\s*&",
                lambda m: f"const {m.group(3)}&", code)
  # Any remaining MSL attribute (e.g. `[[threadgroup(0)]]` or
  # `[[thread_index_in_simdgroup]]` on helper-function parameters).
  code = ATTR_RE.sub(lambda m: re.sub(r"[^\n]", " ", m.group(0)) if is_msl_attribute(m.group(1))
                     else m.group(0), code)
  # MSL literal suffixes: 1.0h (half), 1.0bf (bfloat).
  code = LITERAL_RE.sub(
      lambda m: f"static_cast<{'half' if m.group(2) in 'hH' else 'bfloat'}>({m.group(1)})", code)
  code = remove_address_space_duplicates(code)
  code = rewrite_element_addresses(code)

  # A non-template kernel is its own host name.
  for name, k in kernels.items():
    if not k.is_template:
      instantiations.append((name, name, None))
  for host, func, _ in instantiations:
    if func not in kernels:
      raise PrepassError(f"{path}: host_name {host!r} instantiates unknown kernel {func!r}")
  return code, constants, instantiations, kernels


ELEMENT_ADDRESS_RE = re.compile(r"&\s*(\(\s*)?([A-Za-z_]\w*(?:\s*(?:\.|->)\s*[A-Za-z_]\w*)*)\s*\[")


def rewrite_element_addresses(code: str) -> str:
  """``&p[i]`` / ``&(p[i])`` -> ``::msl::rt::element_address(p, i)``.

  Taking the address of an element of a device buffer would turn the checked
  pointer into a raw one: what is written or read through it afterwards would
  be neither bounds-checked nor counted (library code passes ``&dst[offset]``
  to helpers that store through it). element_address keeps a checked pointer
  (``p + i``) for device buffers and is ``&p[i]`` for anything else. Only a
  unary ``&`` applied to one subscript is rewritten (``&a[i][j]`` is left as
  is).
  """
  out, pos = [], 0
  for m in ELEMENT_ADDRESS_RE.finditer(code):
    if m.start() < pos:
      continue
    before = code[:m.start()].rstrip()
    prev = before[-1:] if before else ""
    # A binary `&` (or `&&`) follows an operand; a unary one does not.
    if (prev.isalnum() or prev in "_)]&" or code[m.start() + 1:m.start() + 2] == "&" or
        re.search(r"\b(operator|template)\s*$", before)):
      continue
    try:
      close = match_close(code, m.end() - 1, "[", "]")
    except PrepassError:
      continue
    end = close + 1
    if m.group(1):  # &( p[i] )
      rest = re.match(r"\s*\)", code[end:])
      if not rest:
        continue
      end += rest.end()
    elif re.match(r"\s*(\[|\.|->|\()", code[end:]):
      continue  # &p[i][j], &p[i].x, ...: not one element of p
    index = code[m.end():close]
    out.append(code[pos:m.start()])
    text = f"::msl::rt::element_address({m.group(2)}, ({index}))"
    out.append(text + "\n" * (code[m.start():end].count("\n") - text.count("\n")))
    pos = end
  out.append(code[pos:])
  return "".join(out)


TYPE_RE = r"[A-Za-z_][\w:]*(?:\s*<[^;<>]*>)?"


def rewrite_threadgroup(code: str) -> str:
  """Threadgroup memory -> tracked elements (``msl::rt::tgelem<T>``, T's layout).

  ``threadgroup T x[N]...;`` (or a scalar) becomes a reference to a
  per-threadgroup arena variable of ``tgelem<T>``, registered under its name;
  ``threadgroup T*`` / ``threadgroup T&`` (parameters, locals, members, casts)
  become ``tgelem<T>*`` / ``tgelem<T>&``. Indexing, pointer arithmetic and
  pointer casts stay native; each element read or write is checked (bounds,
  races) and counted by the runtime.
  """
  def keep_lines(m, text):
    return text + "\n" * m.group(0).count("\n")

  code = re.sub(
      rf"\bthreadgroup\s+({TYPE_RE})\s+(\w+)\s*((?:\[[^\]]+\]\s*)*);",
      lambda m: keep_lines(m, f"auto& {m.group(2)} = ::msl::rt::tg_var<::msl::rt::tgelem<"
                              f"{m.group(1)}>{m.group(3).strip()}>(\"{m.group(2)}\");"),
      code)

  def ptr_sub(m):
    const = "const " if (m.group(1) or m.group(2) or m.group(4)) else ""
    t = m.group(3).strip()
    if t == "void":
      return keep_lines(m, f"{const}void{m.group(5)}")
    return keep_lines(m, f"{const}::msl::rt::tgelem<{t}>{m.group(5)}")
  return re.sub(
      rf"(\bconst\s+)?\bthreadgroup\s+(const\s+)?({TYPE_RE})\s*(\bconst\b\s*)?([*&])",
      ptr_sub, code)


def glue(path: str, constants, instantiations, kernels) -> str:
  g = ["", "// ---- generated by msl_prepass.py: bindings and registration ----",
       "namespace {"]
  # Constant setter (one per file).
  g.append("void msl_emu_set_constants(const ::msl::rt::ConstantValue* v, int n) {")
  for name, (ctype, idx) in constants.items():
    g.append(f"  {name} = static_cast<{ctype}>(::msl::rt::constant_value(v, n, {idx}));")
  g.append("  (void)v; (void)n;")
  g.append("}")
  entries = []
  for i, (host, func, targs) in enumerate(instantiations):
    k = kernels[func]
    attrs = []
    for p in k.params:
      guard = "nullptr"
      if p.guard:
        if p.guard not in constants:
          raise PrepassError(f"{path}: {func}: unknown function constant {p.guard}")
        guard = f"[]() -> bool {{ return static_cast<bool>({p.guard}); }}"
      if p.kind == "buffer":
        attrs.append(f"{{::msl::rt::ParamKind::kBuffer, {p.index}, {guard}, \"{p.name}\"}}")
      elif p.kind == "threadgroup":
        attrs.append(f"{{::msl::rt::ParamKind::kThreadgroup, {p.index}, nullptr, \"{p.name}\"}}")
      else:
        attrs.append(f"{{::msl::rt::ParamKind::kBuiltin, "
                     f"static_cast<int>(::msl::rt::Builtin::{p.index}), nullptr, \"{p.name}\"}}")
    used = [(n, c[1]) for n, c in constants.items() if re.search(rf"\b{n}\b", k.body)]
    g.append(f"const ::msl::rt::ParamAttr msl_emu_attrs_{i}[] = {{")
    g.extend(f"    {a}," for a in attrs)
    g.append("};")
    g.append(f"const ::msl::rt::FunctionConstantDecl msl_emu_consts_{i}[] = {{")
    g.extend(f"    {{{idx}, \"{n}\"}}," for n, idx in used)
    g.append("    {-1, \"\"}};")
    fn = func if targs is None else f"{func}<{targs}>"
    # [[max_total_threads_per_threadgroup(N)]], N evaluated for this
    # instantiation; the runtime refuses larger threadgroups at dispatch.
    limit = "1024"
    if k.max_threads is not None:
      limit = f"msl_emu_max_threads_{func}" + ("()" if targs is None else f"<{targs}>()")
    g.append(f"void msl_emu_run_{i}() {{ ::msl::rt::invoke(&{fn}, msl_emu_attrs_{i}); }}")
    entries.append(f"    {{\"{host}\", \"{path}\", &msl_emu_run_{i}, &msl_emu_set_constants, "
                   f"msl_emu_consts_{i}, {len(used)}, {limit}, "
                   f"{'true' if k.max_threads is not None else 'false'}}},")
  g.append("const ::msl::rt::KernelEntry msl_emu_entries[] = {")
  g.extend(entries)
  g.append("};")
  g.append(f"const ::msl::rt::Registrar msl_emu_registrar(msl_emu_entries, {len(entries)});")
  g.append("}  // namespace")
  return "\n".join(g) + "\n"


def main(argv):
  import argparse
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("input")
  parser.add_argument("output")
  parser.add_argument("--cxx", default=os.environ.get("CXX", "c++"),
                      help="C++ compiler whose preprocessor runs first")
  parser.add_argument("-I", dest="include_dirs", action="append", default=[],
                      help="include search root for the .metal file's #include \"...\"")
  parser.add_argument("--kernels", default=None,
                      help="comma-separated host names: register (and so instantiate) only "
                           "these kernels")
  parser.add_argument("--skip-rule", action="append", default=[],
                      choices=("unroll", "language", "address-space"),
                      help="do not enforce this rule of msl_rules.py (repeatable)")
  parser.add_argument("--clang", default=None,
                      help="clang++ for the address-space rule (without it that rule is skipped)")
  args = parser.parse_args(argv[1:])
  src_path, out_path = args.input, args.output
  try:
    src = preprocess(src_path, args.cxx, args.include_dirs)
    findings = msl_rules.check(src, [r for r in ("unroll", "language")
                                     if r not in args.skip_rule])
    code, constants, insts, kernels = transform(src, src_path)
    if not insts:
      raise PrepassError(f"{src_path}: no [[host_name]] kernel instantiations found")
    if args.kernels is not None:
      wanted = [k for k in args.kernels.split(",") if k]
      missing = sorted(set(wanted) - {host for host, _, _ in insts})
      if missing:
        raise PrepassError(f"{src_path}: no kernel instantiated as {', '.join(missing)}")
      insts = [inst for inst in insts if inst[0] in wanted]
    if args.clang and "address-space" not in args.skip_rule:
      as_code, _, _, _ = transform(src, src_path, address_spaces=True)
      named = "".join(f"[[maybe_unused]] static auto* const msl_emu_instance_{i} = "
                      f"&{func}{'' if targs is None else f'<{targs}>'};\n"
                      for i, (_, func, targs) in enumerate(insts))
      include = os.path.join(os.path.dirname(os.path.abspath(__file__)), "include")
      try:
        findings += msl_rules.check_address_spaces(as_code + "\n" + named, args.clang, include)
      except msl_rules.ClangUnusable as e:
        print(f"msl_prepass: warning: address-space rule skipped: {e}", file=sys.stderr)
    if findings:
      raise PrepassError(f"{src_path} breaks {len(findings)} MSL rule(s) "
                         f"(cpp/metal/emulator/README.md, \"Rules\"):\n" +
                         "\n".join(map(str, findings)))
    text = ("// Generated from " + src_path + " by msl_prepass.py. Do not edit.\n"
            "#include <metal_stdlib>\n" + code + glue(src_path, constants, insts, kernels))
  except PrepassError as e:
    print(f"msl_prepass: error: {e}", file=sys.stderr)
    return 1
  with open(out_path, "w") as f:
    f.write(text)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv))
