"""Rank side: would the ranks' recorded messages finish if every blocking send waited for its receive?

MPI lets a blocking Send return as soon as its buffer may be reused: small messages go at once
(eager), large ones wait until the receiving rank posts its receive (rendezvous). Code that is right
only under eager sends works in a check (small tensors over TCP) and hangs on a cluster with real
activations. Most checks run every blocking Send as Ssend instead (hooks.SYNCHRONOUS); a check that
must keep MPI's own sends (a case module's SEND_WAITS = False: pipeline_step reads when the bytes
left) asks this replay instead, after the fact, over every rank's recorded calls.

The replay is lenient wherever the record is not exact, so an honest order is never called a hang:
every nonblocking receive counts as posted from the start (one from any source is recorded only when
it completes), waits and probes never block, a Sendrecv's send goes at once, tags are not told apart
(the k-th message from a rank to another meets the k-th receive of the other from it), and where two
ranks' records disagree on how many messages passed between them (a receive the recorder did not see)
the replay says nothing.
"""
from __future__ import annotations

BLOCKING_SENDS = ("Send", "send", "Ssend", "ssend", "Rsend")  # any other send (Isend, Bsend, Send_init...) goes
BLOCKING_RECEIVES = ("Recv", "recv", "Sendrecv", "sendrecv", "Sendrecv_replace")  # any other is posted from the start


def _steps(calls: list, rank: int, p: int) -> tuple[list[tuple[str, int, int]], dict[int, list[bool]]]:
    """One rank's calls as steps (kind, peer, k): "send" blocks until its receive is posted, "post" does not,
    "recv" blocks until its message is there; k counts the messages to (or from) that peer before it. And
    {source: for each receive from it in order, whether it was posted without blocking}."""
    steps, sends, receives = [], {}, {}
    for c in calls:
        if "probe" in c.name.lower():  # moves nothing
            continue
        dest, source = (x if isinstance(x, int) and 0 <= x < p and x != rank else None for x in (c.dest, c.source))
        if dest is not None:
            k = sends[dest] = sends.get(dest, -1) + 1
            steps.append(("send" if c.name in BLOCKING_SENDS else "post", dest, k))
        if source is not None:
            mine = receives.setdefault(source, [])
            mine.append(c.name not in BLOCKING_RECEIVES)
            if c.name in BLOCKING_RECEIVES:
                steps.append(("recv", source, len(mine) - 1))
    return steps, receives


def _counts_agree(steps: tuple, receives: tuple) -> bool:
    """Whether every rank received from each other rank as many messages as that rank sent it: where not
    (a receive the recorder could not see, a message never received), the replay has nothing to say."""
    for r, mine in enumerate(steps):
        for peer in {s[1] for s in mine if s[0] != "recv"} | {q for q, got in enumerate(receives) if r in got}:
            if sum(1 for s in mine if s[0] != "recv" and s[1] == peer) != len(receives[peer].get(r, [])):
                return False
    return True


def stuck(everyone: list[list]) -> dict[int, tuple[str, int]] | None:
    """Replay every rank's recorded calls with sends that wait for their receive: None when all finish, else
    {rank: ("send" or "recv", peer)} where each unfinished rank waits. `everyone`: hooks.gather_calls."""
    p = len(everyone)
    steps, receives = zip(*(_steps(calls, r, p) for r, calls in enumerate(everyone))) if p else ((), ())
    if not _counts_agree(steps, receives):
        return None
    at, passed = [0] * p, {}  # each rank's next step; (src, dst) -> sends src has got past
    now = lambda r: steps[r][at[r]] if at[r] < len(steps[r]) else None  # noqa: E731
    moved = True
    while moved:
        moved = False
        for r in range(p):
            while (step := now(r)) is not None:
                kind, peer, k = step
                if kind == "post":
                    passed[(r, peer)] = k + 1
                elif kind == "send":
                    theirs = receives[peer].get(r, [])
                    if now(peer) == ("recv", r, k):  # it waits for this very message: both go on
                        at[peer] += 1
                    elif not (k < len(theirs) and theirs[k]):  # no receive posted for it
                        break
                    passed[(r, peer)] = k + 1
                elif passed.get((peer, r), 0) <= k:  # recv: its message not sent yet
                    if now(peer) != ("send", r, k):
                        break
                    at[peer] += 1
                    passed[(peer, r)] = k + 1
                at[r] += 1
                moved = True
    left = {r: now(r)[:2] for r in range(p) if now(r) is not None}
    return left or None
