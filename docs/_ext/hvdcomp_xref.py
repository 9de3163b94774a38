"""Two conventions of hvdcomp's docstrings, taught to Sphinx (loaded by docs/conf.py).

1. **Cross-references by their Python name.** Docstrings name objects as Python code reaches them:
   ``:class:`hvdcomp.Compressor``` (re-exported by the package), ``:meth:`encode``` inside a
   subclass (inherited), ``:class:`Method``` inside its module. Sphinx indexes each object once, under
   the module that defines it, so such a reference finds no target. When Sphinx finds none, this
   resolver imports the name in the context of the docstring (module, then class and its bases),
   takes the object's defining module and qualified name, and links there. An object that exists
   but has no page (a private ``_name``, deliberately left out of the reference; a class attribute
   without a docstring; an attribute the class sets in its code, ``self.name = ...``) is rendered as
   code without a link. A name that does not resolve in Python
   stays a warning, so ``-n -W`` still fails on a broken reference. Module docstrings get their short
   references written out in full first, since autosummary also shows their first line on the
   package's page, where the module's context is lost.
2. **Attribute docstrings are prose.** Napoleon reads a first line ``word: text`` of a property's or
   constant's docstring as Google style's ``type: description``; hvdcomp's never give a type there
   ("Exact: keeps every element"), so the whole docstring is kept as the description.
3. **NamedTuple fields** are documented by their class's ``Attributes:`` section, not again as
   members ("Alias for field number 0").
4. **Plain-text maths.** ``|x|`` means an absolute value or a norm, not a reST substitution: bars
   outside inline literals are escaped before the docstring is parsed (reST tables are left alone).
"""
from __future__ import annotations

import functools
import importlib
import inspect
import re
import sys
from typing import Any, Iterator, Optional

from docutils import nodes
from sphinx.ext.napoleon.docstring import GoogleDocstring

_LITERAL = re.compile(r"(``.*?``|:[a-z:]+:`[^`]*`)")
_LINE_BLOCK = re.compile(r"\s*\|(\s|$)")
_TABLE_RULE = re.compile(r"^\s*(=+\s+)+=+\s*$|^\s*\+[-=+]+\+\s*$")


@functools.lru_cache(maxsize=None)
def _import(path: str) -> Any:
    """The object ``path`` names (``pkg.mod.Class.attr``), or ``None``."""
    parts = path.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        except Exception:  # noqa: BLE001  (a module that fails to import: no target)
            return None
        try:
            for name in parts[cut:]:
                obj = getattr(obj, name)
        except AttributeError:
            return None
        return obj
    return None


def _candidates(target: str, module: Optional[str], cls: Optional[str]) -> Iterator[str]:
    target = target.lstrip(".~")
    if cls and module:
        owner = _import(f"{module}.{cls}")
        bases = inspect.getmro(owner) if inspect.isclass(owner) else ()
        for base in bases:
            yield f"{base.__module__}.{base.__qualname__}.{target}"
        for base in bases:                    # an inherited docstring naming its own module's objects
            yield f"{base.__module__}.{target}"
    if module:
        yield f"{module}.{target}"
        package = module
        while "." in package:                 # a module's docstring naming a sibling (``topk.num_kept``)
            package = package.rsplit(".", 1)[0]
            yield f"{package}.{target}"
    yield target


def _canonical(obj: Any, path: str) -> Optional[str]:
    """Where ``obj`` is defined: ``module.qualname``."""
    if isinstance(obj, property):
        obj = obj.fget
    if inspect.ismodule(obj):
        return obj.__name__
    func = getattr(obj, "__func__", obj)
    module, qualname = getattr(func, "__module__", None), getattr(func, "__qualname__", None)
    if module and qualname and "<" not in qualname:
        return f"{module}.{qualname}"
    return None


@functools.lru_cache(maxsize=None)
def _source(cls: type) -> str:
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""


def _sets_attribute(path: str) -> bool:
    """``Class.name`` where an hvdcomp class (or a base) assigns ``self.name`` in its code."""
    owner_path, _, name = path.rpartition(".")
    owner = _import(owner_path) if owner_path.startswith("hvdcomp.") else None
    if not inspect.isclass(owner):
        return False
    pattern = re.compile(rf"\bself\.{re.escape(name)}\s*(,|(:[^=\n]+)?=[^=])")   # (also ``self.a, self.b = ...``)
    return any(pattern.search(_source(base)) for base in inspect.getmro(owner) if base.__module__.startswith("hvdcomp"))


def _lookup(target: str, module: Optional[str], cls: Optional[str]):
    """``(path, object)`` of the first candidate that imports, or ``(None, None)``."""
    for path in _candidates(target, module, cls):
        obj = _import(path)
        if obj is not None:
            return path, obj
        if "." in path and _sets_attribute(path):
            return path, _INSTANCE_ATTRIBUTE
    return None, None


_INSTANCE_ATTRIBUTE = object()


def _documented(env, path: str, obj: Any) -> Optional[str]:
    """The name under which Sphinx documents ``obj`` (reached as ``path``), or ``None``."""
    objects = env.get_domain("py").objects
    for name in filter(None, (_canonical(obj, path), path)):
        if name in objects:
            return name
    last = path.rsplit(".", 1)[-1]                 # data re-exported under another module
    if not (isinstance(obj, (bool, int, float, str)) or obj is None):
        for other in objects:
            if other.rsplit(".", 1)[-1] == last and other != path and _import(other) is obj:
                return other
    return None


def resolve(app, env, node, contnode):
    """``missing-reference``: a Python reference by the name Python reaches it (module doc, item 1)."""
    if node.get("refdomain") != "py":
        return None
    target = re.sub(r"\s+", "", node["reftarget"])   # (a role's name wrapped over two lines)
    head = target.lstrip(".~").split(".", 1)[0]
    if head != "hvdcomp" and head in sys.modules:
        return None                                # another project's object (torch.Tensor, ...)
    path, obj = _lookup(target, node.get("py:module"), node.get("py:class"))
    if path is None:
        return None                                # broken: Sphinx warns (and -W fails)
    name = None if obj is _INSTANCE_ATTRIBUTE else _documented(env, path, obj)
    if name is not None:
        return env.get_domain("py").resolve_xref(env, node["refdoc"], app.builder, "obj", name, node, contnode)
    return nodes.literal(target, target.lstrip(".~"))  # private or undocumented: code, no link


_ROLE = re.compile(r":(py:)?(class|func|meth|attr|data|mod|obj|exc):`(?!~?hvdcomp\.)([^`<>]+)`")


def qualify_module_refs(app, what, name, obj, options, lines):
    """``autodoc-process-docstring`` of a module: its short references, e.g. ``:class:`Status```,
    written out in full (``:class:`Status <hvdcomp.step.Status>```), so that they also resolve in
    the summary of the module that autosummary shows on its package's page."""
    if what != "module":
        return
    def full(match):
        role, target = match.group(2), match.group(3).strip()
        path, found = _lookup(target, name, None)
        if path is None or found is _INSTANCE_ATTRIBUTE or path == target.lstrip("~"):
            return match.group(0)
        shown = target.lstrip("~").rsplit(".", 1)[-1] if target.startswith("~") else target
        return f":{role}:`{shown} <{path}>`"
    for i in _prose_lines(lines):
        lines[i] = _ROLE.sub(full, lines[i])


def _prose_lines(lines) -> Iterator[int]:
    """Indices of the lines outside reST simple/grid tables (whose columns must keep their width)."""
    in_table = False
    for i, line in enumerate(lines):
        if _TABLE_RULE.match(line):
            in_table = True
        elif in_table and not line.strip():
            in_table = False
        elif not in_table:
            yield i


def escape_bars(app, what, name, obj, options, lines):
    """``autodoc-process-docstring``: ``|x|`` is maths, not a substitution (module doc, item 4)."""
    for i in _prose_lines(lines):
        line = lines[i]
        if "|" not in line or _LINE_BLOCK.match(line):
            continue
        pieces = _LITERAL.split(line)
        lines[i] = "".join(p if j % 2 else p.replace("|", r"\|") for j, p in enumerate(pieces))


def _prose_attribute(self):
    """``GoogleDocstring._consume_inline_attribute`` without a type (module doc, item 2)."""
    lines = [self._lines.next(), *self._dedent(self._consume_to_end())]
    return "", self.__class__(lines, self._config).lines()


def skip_tuple_fields(app, what, name, obj, skip, options):
    """``autodoc-skip-member``: a NamedTuple's field accessors ("Alias for field number 0"); the
    class docstring's ``Attributes:`` section documents the fields."""
    if (getattr(obj, "__doc__", None) or "").startswith("Alias for field number"):
        return True
    return None


def setup(app):
    GoogleDocstring._consume_inline_attribute = _prose_attribute
    app.connect("missing-reference", resolve, priority=900)
    app.connect("autodoc-process-docstring", escape_bars)
    app.connect("autodoc-process-docstring", qualify_module_refs)
    app.connect("autodoc-skip-member", skip_tuple_fields)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
