"""Static checks on candidate source, run before any candidate code executes.

They reject the cheats and hazards known from KernelBench's static checker, METR's filters and Sakana's
exploit, by reading the AST (not by regex, so comments and strings do not trip them):

- fallbacks: any `try`/`except` (a kernel that fails silently falls back to the reference);
- forging the verdict: `open` (files, /proc), `os._exit`, `sys.exit`, `exit`, `SystemExit` (the verdict is
  computed in the candidate's process, see docs/kernels.md);
- escaping the sandbox or the checks: processes, threads, signals, sockets (`subprocess`, `multiprocessing`,
  `threading`, `concurrent`, `signal`, `socket`, `os.fork`/`system`/`popen`/`exec*`/`kill`/`spawn*`);
- introspection that can reach the reference's results or disable the runtime op recorder (`gc`, `inspect`,
  `sys._getframe`, `torch._C`, `torch.utils._python_dispatch`, `builtins`, `importlib`, `__import__`, `exec`,
  `eval`, `compile`, `globals`), and frames by any route (`traceback`, `logging`, a generator's `gi_frame`,
  `f_back`, `f_locals`, `tb_frame`, ...); the secret seeds' source (`secrets`, `random._urandom`);
- work on side streams (`torch.cuda.Stream`, `torch.cuda.stream(...)`), which timing on the default stream
  would miss;
- attribute access by computed name (`getattr(x, name)` with a non-literal name, `operator.attrgetter`,
  `vars`), the usual way around all of the above, and the private or dunder attributes that reach torch's
  internals or the interpreter's (`x._C` under any alias, `_DisableTorchDispatch`, `__dict__`,
  `__class__`, `__subclasses__`, `__globals__`, ...);
- rebinding a name in an imported module (`torch.softmax = ...`, `setattr(torch, "relu", f)`): the
  reference calls the same torch, so a patch changes what the candidate is compared against and timed
  with (the worker also checks torch's namespaces at run time);
- running other files (`runpy`): the reference's file is in the worker's folder;
- importing steptune (the evaluator's own checks, op lists and clock live there), `__setattr__` /
  `__delattr__` (rebinding past the rebinding check), and defining `__torch_function__` /
  `__torch_dispatch__` (a tensor subclass whose operations run inside the evaluator's comparisons).

Static checks are the first line only. The worker also checks at run time: the aten ops the candidate
dispatches (calling the reference's op sequence is rejected), output aliasing, input mutation, guard bytes
around inputs, threads left running, and processes left running. A candidate that passes here can still be
rejected there.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

__all__ = ["Finding", "static_check"]

_BANNED_MODULES = {
    "subprocess": "starts processes",
    "multiprocessing": "starts processes",
    "threading": "starts threads",
    "_thread": "starts threads",
    "concurrent": "starts threads or processes",
    "signal": "handles signals",
    "socket": "opens sockets",
    "gc": "can reach the reference's tensors",
    "inspect": "can reach the evaluator's frames",
    "traceback": "can reach the evaluator's frames (traceback.walk_stack)",
    "logging": "can reach the evaluator's frames (logging.currentframe)",
    "secrets": "can fix the evaluator's secret seeds",
    "builtins": "can rebind builtins",
    "importlib": "imports by computed name",
    "pickle": "can run arbitrary code",
    "asyncio": "starts an event loop",
    "steptune_problem": "reaches the reference module",
    "runpy": "runs other files (the reference's among them)",
    "steptune_candidate": "reaches the evaluator's module table",
    "steptune": "reaches the evaluator (its checks, its op lists and its clock); a C kernel imports "
    "only `from steptune.kernels.cext import load_c, ptr`",
}
# The one way into steptune a kernel needs: the C build helper's public names (cext.__all__; a test keeps the
# two equal, since importing cext here would import torch into the CLI), by from-import only (a module object
# would reach its own imports: cext.subprocess).
_ALLOWED_FROM = {"steptune.kernels.cext": {"DEFAULT_CFLAGS", "CompileError", "compiler", "load_c", "ptr"}}
_BANNED_OS = {
    "fork", "forkpty", "system", "popen", "kill", "killpg", "spawnv", "spawnl", "posix_spawn",
    "_exit", "abort",
}  # fmt: skip
_BANNED_CALLS = {
    "__import__": "imports by computed name",
    "exec": "runs generated code",
    "eval": "runs generated code",
    "compile": "compiles generated code",
    "globals": "reaches module state by name",
    "breakpoint": "enters a debugger",
    "open": "writes or reads files (a kernel needs neither; C builds go through cext.load_c)",
    "exit": "ends the process before it is judged",
    "quit": "ends the process before it is judged",
    "vars": "reads a namespace by computed name",
}
_BANNED_ATTR_PATHS = {
    "torch._C": "reaches torch internals (can disable the runtime op recorder)",
    "torch.utils._python_dispatch": "can disable the runtime op recorder",
    "torch.cuda.Stream": "runs work on a side stream that timing would miss",
    "torch.cuda.stream": "runs work on a side stream that timing would miss",
    "sys._getframe": "can reach the evaluator's frames",
    "sys.modules": "can reach the reference module",
    "sys.settrace": "hooks the evaluator",
    "sys.setprofile": "hooks the evaluator",
    "sys.exit": "ends the process before it is judged",
    "operator.attrgetter": "reads attributes by computed name",
    "operator.methodcaller": "calls methods by computed name",
}
# Attributes no kernel needs, whatever object they are read from: torch internals that can turn the op
# recorder off (reached through any alias, e.g. torch.nn.functional.torch._C), and the interpreter's
# introspection (the classic route from any object to every class and module).
_BANNED_ATTRS = {
    "_C": "reaches torch internals (can disable the runtime op recorder)",
    "__dict__": "reads a namespace by computed name",
    "__class__": "reaches the interpreter's classes",
    "__base__": "reaches the interpreter's classes",
    "__bases__": "reaches the interpreter's classes",
    "__mro__": "reaches the interpreter's classes",
    "__subclasses__": "reaches the interpreter's classes",
    "__globals__": "reaches another module's globals",
    "__code__": "rewrites functions",
    "__closure__": "reaches another function's state",
    "__getattribute__": "reads attributes by computed name",
    "__self__": "reaches a bound method's owner",
    "__func__": "reaches a bound method's function",
    "__wrapped__": "reaches a wrapped function",
    "sys": "reaches the interpreter's module table through another module (torch.sys.modules)",
    "pythonapi": "calls the interpreter's C API (imports any module, the evaluator's among them)",
    "py_object": "turns the interpreter's C API results into objects",
    "__setattr__": "rebinds attributes past the rebinding check (time.__setattr__('perf_counter', ...))",
    "__delattr__": "deletes attributes past the rebinding check",
    # the evaluator's frames (a red team read every reference output from prep's locals through a
    # generator's gi_frame.f_back, then looked each call up: "correct", 7x)
    "f_back": "can reach the evaluator's frames",
    "f_locals": "can reach the evaluator's frames",
    "f_globals": "can reach the evaluator's frames",
    "f_code": "can reach the evaluator's frames",
    "gi_frame": "can reach the evaluator's frames",
    "cr_frame": "can reach the evaluator's frames",
    "ag_frame": "can reach the evaluator's frames",
    "gi_yieldfrom": "can reach the evaluator's frames",
    "tb_frame": "can reach the evaluator's frames",
    "tb_next": "can reach the evaluator's frames",
    "__traceback__": "can reach the evaluator's frames",
    "currentframe": "can reach the evaluator's frames",
    "_getframe": "can reach the evaluator's frames",
    "_urandom": "can fix the evaluator's secret seeds (random._urandom)",
    "__torch_function__": "makes a tensor subclass whose operations run the candidate's code inside the "
    "evaluator's own checks",
    "__torch_dispatch__": "makes a tensor subclass whose operations run the candidate's code inside the "
    "evaluator's own checks",
}
_BANNED_ATTR_PARTS = ("TorchDispatch", "TorchFunction", "dispatch_mode")
_SUBCLASS_HOOKS = ("__torch_function__", "__torch_dispatch__")


@dataclass(frozen=True, slots=True)
class Finding:
    """One rule a candidate broke, with the line it broke it on."""

    rule: str
    line: int
    detail: str

    def __str__(self) -> str:
        return f"line {self.line}: {self.detail} ({self.rule})"


def _dotted(node: ast.AST) -> str | None:
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        parts.append(node.id)
        return ".".join(reversed(parts))
    return None


class _Visitor(ast.NodeVisitor):
    def __init__(self) -> None:
        self.findings: list[Finding] = []
        self.aliases: dict[str, str] = {}  # local name -> module path, from imports

    def _add(self, rule: str, node: ast.AST, detail: str) -> None:
        self.findings.append(Finding(rule, getattr(node, "lineno", 0), detail))

    def _module(self, name: str, node: ast.AST) -> None:
        root = name.split(".")[0]
        if root in _BANNED_MODULES:
            self._add("banned-import", node, f"imports {name}, which {_BANNED_MODULES[root]}")
        for path, why in _BANNED_ATTR_PATHS.items():
            if name == path or name.startswith(path + "."):
                self._add("banned-import", node, f"imports {name}, which {why}")

    def visit_Import(self, node: ast.Import) -> None:
        for a in node.names:
            self._module(a.name, node)
            self.aliases[a.asname or a.name.split(".")[0]] = a.name if a.asname else a.name.split(".")[0]

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        mod = node.module or ""
        allowed = node.level == 0 and all(a.name in _ALLOWED_FROM.get(mod, ()) for a in node.names)
        if not allowed:
            self._module(mod, node)
        for a in node.names:
            full = f"{mod}.{a.name}"
            if not allowed:
                self._module(full, node)
            if mod == "os" and (a.name in _BANNED_OS or a.name.startswith(("exec", "spawn"))):
                self._add("banned-call", node, f"imports os.{a.name}, which starts, kills or ends processes")
            self.aliases[a.asname or a.name] = full

    def visit_Try(self, node: ast.Try) -> None:
        self._add("try-fallback", node, "try/except can hide a failing kernel behind a fallback")
        self.generic_visit(node)

    visit_TryStar = visit_Try  # type: ignore[assignment]

    def _resolve(self, dotted: str) -> str:
        head, _, rest = dotted.partition(".")
        base = self.aliases.get(head, head)
        return f"{base}.{rest}" if rest else base

    def _banned_attr(self, name: str, node: ast.AST) -> bool:
        why = _BANNED_ATTRS.get(name)
        if why is None and any(part in name for part in _BANNED_ATTR_PARTS):
            why = "can disable the runtime op recorder"
        if why is not None:
            self._add("banned-attribute", node, f"uses the attribute {name}, which {why}")
        return why is not None

    def _rebinds(self, target: ast.AST, node: ast.AST) -> None:
        if isinstance(target, ast.Tuple | ast.List):
            for t in target.elts:
                self._rebinds(t, node)
            return
        if isinstance(target, ast.Starred):
            self._rebinds(target.value, node)
            return
        if not isinstance(target, ast.Attribute):
            return
        dotted = _dotted(target)
        if dotted is not None and dotted.split(".")[0] in self.aliases:
            self._add(
                "rebinds-library",
                node,
                f"rebinds {self._resolve(dotted)}, which the reference uses too (a patched library changes "
                "what the candidate is compared against and timed with)",
            )

    def visit_Assign(self, node: ast.Assign) -> None:
        for t in node.targets:
            self._rebinds(t, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node: ast.AugAssign) -> None:
        self._rebinds(node.target, node)
        self.generic_visit(node)

    def visit_AnnAssign(self, node: ast.AnnAssign) -> None:
        self._rebinds(node.target, node)
        self.generic_visit(node)

    def visit_Delete(self, node: ast.Delete) -> None:
        for t in node.targets:
            self._rebinds(t, node)
        self.generic_visit(node)

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if self._banned_attr(node.attr, node):
            return
        dotted = _dotted(node)
        if dotted is not None:
            full = self._resolve(dotted)
            for path, why in _BANNED_ATTR_PATHS.items():
                if full == path or full.startswith(path + "."):
                    self._add("banned-attribute", node, f"uses {full}, which {why}")
                    return
            mod, _, attr = full.rpartition(".")
            if mod == "os" and (attr in _BANNED_OS or attr.startswith(("exec", "spawn"))):
                self._add("banned-call", node, f"uses os.{attr}, which starts, kills or ends processes")
                return
        self.generic_visit(node)

    def visit_Call(self, node: ast.Call) -> None:
        if isinstance(node.func, ast.Name):
            name = node.func.id
            if name in _BANNED_CALLS and name not in self.aliases:
                self._add("banned-call", node, f"calls {name}(), which {_BANNED_CALLS[name]}")
            if name in ("getattr", "setattr", "delattr", "hasattr") and len(node.args) >= 2:
                key = node.args[1]
                if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                    self._add("computed-attribute", node, f"{name}() with a computed name can bypass checks")
                elif not self._banned_attr(key.value, node) and name in ("setattr", "delattr"):
                    head = _dotted(node.args[0])
                    if head is not None and head.split(".")[0] in self.aliases:
                        self._add(
                            "rebinds-library",
                            node,
                            f"{name}() on {self._resolve(head)}.{key.value}, which the reference uses too",
                        )
        self.generic_visit(node)

    def visit_FunctionDef(self, node: ast.FunctionDef | ast.AsyncFunctionDef) -> None:
        if node.name in _SUBCLASS_HOOKS:  # defining it (in a class body) is the route, not reading it
            self._add("banned-attribute", node, f"defines {node.name}, which {_BANNED_ATTRS[node.name]}")
        self.generic_visit(node)

    visit_AsyncFunctionDef = visit_FunctionDef  # type: ignore[assignment]

    def visit_Name(self, node: ast.Name) -> None:
        if node.id in _SUBCLASS_HOOKS:  # ``__torch_function__ = ...`` in a class body
            self._add("banned-attribute", node, f"binds {node.id}, which {_BANNED_ATTRS[node.id]}")
        if node.id == "SystemExit":
            self._add("banned-call", node, "raises SystemExit, which ends the process before it is judged")
        if node.id in ("__builtins__", "__loader__", "__spec__"):
            self._add("banned-attribute", node, f"uses {node.id}, which can reach builtins or the importer")


def static_check(source: str) -> list[Finding]:
    """Rules `source` breaks (empty when it passes). A syntax error is not a finding: it is a compile error,
    reported by the worker with the interpreter's own message."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    v = _Visitor()
    v.visit(tree)
    return v.findings
