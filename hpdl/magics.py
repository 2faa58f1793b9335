"""The `%hpdl` line magic: start, stop, restart or look at the ranks from a notebook.

    %hpdl start -n 4 --frameworks torch
    %hpdl status
    %hpdl panel          # the live table of the ranks (hpdl.panel())

(`%%px`, which runs a cell on every rank, is hpdl/cluster/px.py, registered by hpdl.start().)
"""
from __future__ import annotations

import shlex

from IPython.core import magic_arguments
from IPython.core.error import UsageError

from hpdl.cluster import lifecycle
from hpdl.errors import HpdlError

VERBS = ("start", "stop", "restart", "status", "panel")
USAGE = ("%hpdl start [-n N] [--launcher L] [--frameworks torch,horovod] [--timeout S] | stop | restart | status "
         "| panel")


@magic_arguments.magic_arguments(name="hpdl")
@magic_arguments.argument("verb", nargs="?", help="start | stop | restart | status | panel")
@magic_arguments.argument("-n", "--n", dest="n", metavar="N", help="number of ranks")
@magic_arguments.argument("-l", "--launcher", help="local, slurm or auto")
@magic_arguments.argument("--frameworks", help="comma list, e.g. torch,horovod; '' for MPI only")
@magic_arguments.argument("--timeout", dest="cell_timeout", metavar="SECONDS", help="time limit of each %%%%px cell")
def hpdl_magic(line: str):
    """Start, stop, restart or look at the ranks (status, or the live panel)."""
    usage = USAGE
    try:  # shell quoting, so that --frameworks '' means none
        args = hpdl_magic.parser.parse_args(shlex.split(line))
    except (UsageError, ValueError) as exc:
        raise HpdlError(f"%hpdl: {exc}. {usage}") from None
    verb = args.verb
    if verb is None:
        print(usage)
        return None
    if verb not in VERBS:
        raise HpdlError(f"%hpdl: no verb {verb!r}. {usage}")
    opts: dict = {}
    if args.n is not None:
        try:
            opts["n"] = int(args.n)
        except ValueError:
            raise HpdlError(f"%hpdl {verb} -n takes a whole number of ranks; got {args.n!r}.") from None
    if args.launcher is not None:
        opts["launcher"] = args.launcher
    if args.frameworks is not None:
        opts["frameworks"] = tuple(x for x in args.frameworks.split(",") if x)
    if args.cell_timeout is not None:
        try:
            opts["cell_timeout"] = float(args.cell_timeout)
        except ValueError:
            raise HpdlError(f"%hpdl {verb} --timeout takes seconds; got {args.cell_timeout!r}.") from None
    if verb == "start":
        lifecycle.start(**opts)
    elif verb == "stop":
        lifecycle.stop()
    elif verb == "restart":
        lifecycle.restart(**opts)
    elif verb == "panel":
        from hpdl import panel

        return panel.show()
    else:
        return lifecycle.status()
    return None


def register(ip) -> None:
    from hpdl.errors import install_handler

    install_handler(ip)
    ip.register_magic_function(hpdl_magic, "line", "hpdl")
