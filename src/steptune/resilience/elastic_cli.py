"""``steptune resilience elastic``: run your own ``fn(ctx, *args)`` loop under ``elastic.launch``, like
torchrun runs a script, with fail-stop survival instead of restart-everything."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

from steptune.core.argtypes import output_file, positive_float, positive_int

__all__ = ["register"]


def resolve(target: str) -> Any:
    """``module:function`` or ``path/to/file.py:function``, importable again by the spawned ranks."""
    where, sep, name = target.rpartition(":")
    if not sep or not where or not name:
        raise ValueError(f"target must be module:function or file.py:function, got {target!r}")
    file = Path(where).resolve() if where.endswith(".py") else None
    if file is not None:
        if not file.is_file():
            raise ValueError(f"no such file: {where}")
        if str(file.parent) not in sys.path:  # appended, so the file's neighbours cannot shadow installed
            sys.path.append(str(file.parent))  # modules; spawned ranks get this sys.path
        where = file.stem
    elif os.getcwd() not in sys.path:  # a module in the current folder, as `python -m` finds it (appended)
        sys.path.append(os.getcwd())
    try:
        module = importlib.import_module(where)
    except Exception as err:  # ImportError, or the file's own error (a SyntaxError, ...)
        raise ValueError(f"cannot import {where!r}: {type(err).__name__}: {err}") from err
    found = getattr(module, "__file__", None)
    if file is not None and found and Path(found).resolve() != file:
        raise ValueError(f"{file.name} is shadowed by the module {where!r} at {found}: rename the file")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise ValueError(f"{where} has no function {name!r}")
    return fn


def _check_call(target: str, fn: Any, fn_args: list[str]) -> None:
    """Refuse, before any rank starts, arguments the function cannot take (each rank would raise a
    TypeError in its first line, after the group formed)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # no signature to check (a builtin)
        return
    try:
        sig.bind(None, *fn_args)
    except TypeError as exc:
        given = ", ".join(["ctx", *map(repr, fn_args)])
        name = getattr(fn, "__name__", target)  # a functools.partial or a callable object has none
        raise ValueError(
            f"{target}: {name}{sig} cannot be called as {name}({given}): {exc}. What follows "
            "the target goes to the function, as strings"
        ) from None


def _run(args: argparse.Namespace) -> int:
    from steptune.resilience.elastic import launch, lost_reason, recovery_text

    fn = resolve(args.target)
    where = args.target.rpartition(":")[0]
    if where.endswith(".py") and args.json and Path(where).resolve() == Path(args.json).resolve():
        raise ValueError(  # the results replaced the training script (a sweep)
            f"--json {args.json} is the training script {args.target} names: give --json another path"
        )
    fn_args = args.args[1:] if args.args[:1] == ["--"] else list(args.args)
    ours = {s for a in args._parser._actions for s in a.option_strings}
    misplaced = [a for a in fn_args if a.split("=", 1)[0] in ours]
    if misplaced:
        print(
            f"steptune resilience elastic: warning: {misplaced} come after the target, so they go to the "
            "function, not to this command (put options before the target)",
            file=sys.stderr,
        )
    _check_call(args.target, fn, fn_args)
    try:
        res = launch(
            fn, args.nproc_per_node, *fn_args, timeout_s=args.timeout, group_timeout_s=args.group_timeout,
            threads=args.threads, nnodes=args.nnodes, node_rank=args.node_rank, master=args.master,
            host=args.host, node_timeout_s=args.node_timeout, hang_timeout_s=args.hang_timeout,
        )  # fmt: skip
    except (RuntimeError, TimeoutError) as err:  # the job stopped: a rank's own error, or out of time
        print(f"steptune resilience elastic: {err}", file=sys.stderr)
        return 1
    for rank, code in sorted(res["lost"].items()):
        hung = res.get("hung", {}).get(rank)
        why = lost_reason(code) if hung is None else f"hung: silent {hung:g} s as its peers rejoined; killed"
        print(f"rank {rank} lost ({why})")
    for rank, recs in sorted(res["recoveries"].items()):
        for rec in recs:
            print(f"rank {rank}: {recovery_text(rec)}")
    print(f"survivors {res['survivors']}; {res['wall_s']:.1f} s")
    if args.json:
        notes: list[str] = []
        out = _jsonable({**res, "results": {str(r): v for r, v in res["results"].items()}}, "$", notes)
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1, allow_nan=False))
        print(f"wrote: {args.json}" + (f" ({'; '.join(notes[:5])})" if notes else ""))
    return 0


def _jsonable(x: Any, where: str, notes: list[str]) -> Any:
    """``x`` as strict JSON: keys as strings, tuples and sets as lists, numpy and torch values as numbers or
    lists, NaN and infinities as null (noted); anything else as its repr (noted). A sweep: tuple keys
    raised after the job and lost its results, NaN was written, arrays became repr strings."""
    if isinstance(x, bool) or x is None or isinstance(x, str | int):
        return x
    if isinstance(x, float):
        if math.isfinite(x):
            return x
        notes.append(f"{where}: {x} written as null")
        return None
    if isinstance(x, dict):
        return {
            (k if isinstance(k, str) else str(k)): _jsonable(v, f"{where}[{k!r}]", notes)
            for k, v in x.items()
        }
    if isinstance(x, list | tuple):
        return [_jsonable(v, f"{where}[{i}]", notes) for i, v in enumerate(x)]
    if isinstance(x, set | frozenset):
        return [_jsonable(v, f"{where}[{i}]", notes) for i, v in enumerate(sorted(x, key=repr))]
    tolist = getattr(x, "tolist", None)  # numpy arrays and scalars, torch tensors
    if callable(tolist):
        with contextlib.suppress(Exception):
            return _jsonable(tolist(), where, notes)
    notes.append(f"{where}: a {type(x).__name__} written as its repr")
    return repr(x)


def register(verbs: Any) -> None:
    e = verbs.add_parser(
        "elastic",
        help="run your own fn(ctx, *args) training loop with fail-stop survival (torchrun-like)",
        description="Spawns --nproc-per-node ranks running TARGET(ctx, *ARGS) (ARGS as strings), where ctx "
        "is a steptune.resilience.elastic.Elastic: when a rank (or, with --nnodes > 1, a host) dies, the "
        "others rejoin and redo the step instead of restarting. Run it on every host with its --node-rank. "
        "Options come before TARGET; everything after it goes to the function.",
    )
    e.add_argument("target", help="module:function or path/to/file.py:function (a module-level function)")
    e.add_argument("args", nargs=argparse.REMAINDER, help="arguments passed to the function, as strings")
    e.add_argument(
        "--nproc-per-node", "--nproc_per_node", type=positive_int, default=1, help="ranks on this host"
    )
    e.add_argument("--nnodes", type=positive_int, default=1, help="hosts in the job")
    e.add_argument("--node-rank", type=int, default=0, help="this host's index, 0..nnodes-1")
    e.add_argument("--master", default=None, help="HOST:PORT of node 0, or file:PATH on a shared filesystem")
    e.add_argument("--host", default=None, help="this host's address for gloo (default: the route to node 0)")
    e.add_argument("--group-timeout", type=positive_float, default=20.0, help="seconds a collective waits")
    e.add_argument("--node-timeout", type=positive_float, default=5.0, help="silent seconds that lose a host")
    e.add_argument(
        "--hang-timeout", type=positive_float, default=None,
        help="seconds a rank may stay silent while its peers rejoin before it is killed as hung "
        "(default: twice --group-timeout, 10 s at least)",
    )  # fmt: skip
    e.add_argument(
        "--timeout", type=positive_float, default=None, help="seconds for the whole job (default: no limit)"
    )
    e.add_argument("--threads", type=positive_int, default=1, help="torch threads per rank")
    e.add_argument("--json", type=output_file, default=None, help="also write results and recoveries here")
    e.set_defaults(func=_run)
