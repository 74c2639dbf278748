#!/usr/bin/env python3
"""MSL emulator front end: turns an unmodified .metal file into C++.

The C++ compiler cannot read MSL attributes (``[[buffer(0)]]``,
``[[threadgroup_position_in_grid]]``, ...) and MSL's address spaces mean
something C++ has no word for. This pre-pass

* runs the C preprocessor over the source first (local includes, macros such
  as instantiation lists; the Metal standard headers are left to the shim),
* records every ``[[kernel]]`` function's parameters and their attributes,
* records every ``[[host_name("...")]]`` instantiation and every
  ``[[function_constant(N)]]`` declaration,
* rewrites ``device``/``constant`` pointers into bounds-checked ``msl::rt::dptr``,
  ``threadgroup`` declarations into per-threadgroup arena variables of tracked
  elements (``msl::rt::tgelem``; threadgroup pointers and references likewise)
  and function constants into thread-local variables set per dispatch,
* removes the attributes (the preprocessor's line markers keep compiler errors
  pointing at the right line of the .metal file), and
* appends glue that binds buffers/builtins to parameters and registers each
  instantiated kernel under its host name with the emulator runtime.

Usage: msl_prepass.py INPUT.metal OUTPUT.cc [--cxx COMPILER] [-I DIR ...]
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass, field

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
  return proc.stdout


def transform(src: str, path: str):
  """``src`` is the preprocessed source of ``path``."""
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

  # Kernel definitions.
  out, pos = [], 0
  for m in re.finditer(r"\[\[\s*kernel\s*\]\]\s*void\s+(\w+)\s*\(", code):
    name = m.group(1)
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
    kernel.is_template = bool(re.search(r"template\s*<[^;{}]*>\s*$", code[:m.start()]))
    kernels[name] = kernel
    head = code[m.start():m.start() + len(m.group(0)) - 1]
    head = re.sub(r"\[\[\s*kernel\s*\]\]", lambda a: " " * len(a.group(0)), head)
    out.append(code[pos:m.start()])
    out.append(head + "(" + ",".join(new_params) + ")")
    pos = close_paren + 1
  out.append(code[pos:])
  code = "".join(out)

  code = rewrite_threadgroup(code)
  # device / constant pointers -> checked pointers.
  ptr_re = re.compile(
      r"(\bconst\s+)?\b(device|constant)\s+(const\s+)?([A-Za-z_][\w:]*(?:\s*<[^;<>()]*>)?)\s*\*")

  def ptr_sub(m):
    is_const = bool(m.group(1) or m.group(3)) or m.group(2) == "constant"
    t = m.group(4)
    return f"::msl::rt::dptr<{'const ' if is_const else ''}{t}> "
  code = ptr_re.sub(ptr_sub, code)
  code = re.sub(r"(\bconst\s+)?\bconstant\s+(const\s+)?([A-Za-z_][\w:]*)\s*&",
                lambda m: f"const {m.group(3)}&", code)
  # Any remaining MSL attribute (e.g. on helper-function parameters).
  names = "|".join(list(BUILTINS) + ["kernel"])
  code = re.sub(r"\[\[\s*(" + names + r")\s*\]\]", lambda m: " " * len(m.group(0)), code)

  # A non-template kernel is its own host name.
  for name, k in kernels.items():
    if not k.is_template:
      instantiations.append((name, name, None))
  for host, func, _ in instantiations:
    if func not in kernels:
      raise PrepassError(f"{path}: host_name {host!r} instantiates unknown kernel {func!r}")
  return code, constants, instantiations, kernels


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
    g.append(f"void msl_emu_run_{i}() {{ ::msl::rt::invoke(&{fn}, msl_emu_attrs_{i}); }}")
    entries.append(f"    {{\"{host}\", \"{path}\", &msl_emu_run_{i}, &msl_emu_set_constants, "
                   f"msl_emu_consts_{i}, {len(used)}}},")
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
  parser.add_argument("-I", dest="include_dirs", action="append", default=[])
  args = parser.parse_args(argv[1:])
  src_path, out_path = args.input, args.output
  try:
    src = preprocess(src_path, args.cxx, args.include_dirs)
    code, constants, insts, kernels = transform(src, src_path)
    if not insts:
      raise PrepassError(f"{src_path}: no [[host_name]] kernel instantiations found")
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
