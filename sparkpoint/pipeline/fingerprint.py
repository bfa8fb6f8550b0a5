"""A stable text of what an operator's function computes with, for `Pipeline.code_version`.

Dagster compares code versions made in different processes, so nothing here depends on memory
addresses, hash seeds or the order things were built in. For a function it covers:

- its source (its bytecode where no source is kept: a REPL, `exec`);
- its closure cells, defaults and keyword defaults: what a factory bakes in
  (`over(threshold=10)` and `over(threshold=1000)` differ);
- the module globals it names, its nested lambdas' and comprehensions' included: constants,
  codecs, helper functions;
- `functools.partial` (the function, its arguments and keywords) and bound methods (the
  function and its instance).

Values are read as: None, booleans, numbers, strings and bytes by their repr; tuples, lists,
dicts, sets and frozensets element by element (sets and dicts in a sorted order); enum members by
name; dataclass instances by their type and fields; classes and modules by their qualified name;
a function as above when it is defined in the same top-level package as the operator's function,
by its qualified name otherwise (an installed library changes with its version, it is not read);
any other object by its type's qualified name and its repr when its class defines one that shows
no memory address.

Not covered: the source of the class of an object a function closes over (a method changed in
it), the state of an object whose class has no dataclass fields and no repr of its own, what a
truncated repr leaves out (a large array, a DataFrame), what a function reaches through another
module's attributes (`helpers.THRESHOLD`) or an object's, a helper function in another top-level
package, and builtins. A value that changes while the process runs (a cache the operator fills)
is read as it is when the version is computed: when the definitions load.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import inspect
import re
import types
from typing import Any

_PLAIN = (type(None), bool, int, float, complex, str, bytes)
_ADDRESS = re.compile(r"0x[0-9a-fA-F]{6,}")


def fingerprint(fn: Any) -> str:
    """The stable text of `fn` and of the values it computes with (see the module docstring)."""
    return _Reader().read(fn)


class _Reader:
    def __init__(self) -> None:
        self.package: str | None = None  # the operator's function's top-level package
        self.open: set[int] = set()  # values being read: met again inside themselves, they are named only

    def read(self, value: Any) -> str:
        if isinstance(value, _PLAIN):
            return repr(value)
        if id(value) in self.open:
            return f"<recursive {_name(type(value))}>"
        self.open.add(id(value))
        try:
            return self._compound(value)
        finally:
            self.open.discard(id(value))

    def _compound(self, value: Any) -> str:
        kind = type(value).__qualname__
        if isinstance(value, enum.Enum):
            return f"{_name(type(value))}.{value.name}"
        if isinstance(value, (tuple, list)):
            return f"{kind}({', '.join(self.read(v) for v in value)})"
        if isinstance(value, (set, frozenset)):
            return f"{kind}({', '.join(sorted(self.read(v) for v in value))})"
        if isinstance(value, dict):
            return f"{kind}({', '.join(sorted(f'{self.read(k)}: {self.read(v)}' for k, v in value.items()))})"
        if isinstance(value, functools.partial):
            return f"partial({self.read(value.func)}, {self.read(value.args)}, {self.read(value.keywords)})"
        if isinstance(value, types.MethodType):
            return f"method({self.read(value.__func__)}, {self.read(value.__self__)})"
        if isinstance(value, types.FunctionType):
            return self._function(value)
        if isinstance(value, types.BuiltinFunctionType):
            return f"builtin {getattr(value, '__module__', None) or ''}.{value.__qualname__}"
        if isinstance(value, types.ModuleType):
            return f"module {value.__name__}"
        if isinstance(value, type):
            return f"class {_name(value)}"
        if dataclasses.is_dataclass(value):
            fields = ", ".join(f"{f.name}={self.read(getattr(value, f.name, None))}" for f in dataclasses.fields(value))
            return f"{_name(type(value))}({fields})"
        return f"{_name(type(value))} {_own_repr(value)}".rstrip()

    def _function(self, fn: types.FunctionType) -> str:
        package = (fn.__module__ or "").partition(".")[0]
        if self.package is None:
            self.package = package
        name = f"function {fn.__module__}.{fn.__qualname__}"
        if package != self.package:
            return name
        parts = [name, self._source(fn)]
        for cell_name, cell in zip(fn.__code__.co_freevars, fn.__closure__ or ()):
            try:
                parts.append(f"closes over {cell_name} = {self.read(cell.cell_contents)}")
            except ValueError:  # a cell not filled yet (a name assigned after the function)
                parts.append(f"closes over {cell_name}, empty")
        parts.append(f"defaults {self.read(fn.__defaults__)} {self.read(fn.__kwdefaults__)}")
        names = _global_names(fn.__code__)
        parts.extend(f"global {g} = {self.read(fn.__globals__[g])}" for g in sorted(names) if g in fn.__globals__)
        return "\n".join(parts)

    def _source(self, fn: types.FunctionType) -> str:
        try:
            return inspect.getsource(fn)
        except (OSError, TypeError):  # defined where no source is kept: its bytecode, stable per Python version
            return self._code(fn.__code__)

    def _code(self, code: types.CodeType) -> str:
        consts = ", ".join(self._code(c) if isinstance(c, types.CodeType) else self.read(c) for c in code.co_consts)
        return f"{code.co_code.hex()} ({consts}) {code.co_names}"


def _global_names(code: types.CodeType) -> set[str]:
    """The names `code` and the code nested in it load (globals, and attribute names, which are
    only read when a global of that name exists)."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def _name(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def _own_repr(value: Any) -> str:
    """The value's repr when its class defines one and it shows no memory address; else ''."""
    if not any("__repr__" in vars(cls) for cls in type(value).__mro__ if cls is not object):
        return ""
    try:
        text = repr(value)
    except Exception:  # a repr that fails says nothing stable
        return ""
    return "" if _ADDRESS.search(text) else text
