"""Rank side: would the ranks' recorded messages finish if every blocking send waited for its receive?

MPI lets a blocking Send return as soon as its buffer may be reused: small messages go at once
(eager), large ones wait until the receiving rank posts its receive (rendezvous). Code that is right
only under eager sends works in a check (small tensors over TCP) and hangs on a cluster with real
activations. Most checks run every blocking Send as Ssend instead (hooks.SYNCHRONOUS); a check that
must keep MPI's own sends (a case module's SEND_WAITS = False: pipeline_step reads when the bytes
left) asks this replay instead, after the fact, over every rank's recorded calls.

The replay is lenient wherever the record is not exact, so an honest order is never called a hang: a
nonblocking receive counts as posted where it was called only when the recorder saw both its call and
its completion (Context.waits), else from the start (one from any source is noted only as it
completes; a persistent request's first start from where it was made); a request blocks only where its
completion was seen (Wait, Waitall, a Test that found it done; a persistent one's by Wait, Waitall, Test or
Testall alone; never Free); probes never block; tags are not told apart
(the k-th message from a rank to another meets the k-th receive of the other from it); and where two
ranks' records disagree on how many messages passed between them (a receive the recorder did not see)
the replay says nothing. A Sendrecv posts its send, receives, then waits for its send to be received.
"""
from __future__ import annotations

from hpdl.checker.hooks import BLOCKING_RECEIVES, SYNCHRONOUS  # any other receive: posted from the start

BLOCKING_SENDS = (*SYNCHRONOUS, *SYNCHRONOUS.values(), "Rsend")  # any other send (Isend, Bsend, Send_init...) goes


def _steps(calls: list, rank: int, p: int, waits: list = ()) -> tuple[list[tuple], dict[int, list[bool]], set]:
    """One rank's calls as steps (kind, peer, k): "send" blocks until its receive is posted, "post" does not,
    "recv" blocks until its message is there, "irecv" posts a receive, ("wait", kind, peer, k) blocks until
    that Isend's receive is posted or that Irecv's message sent; k counts the messages to (or from) that peer
    before it. And {source: for each receive from it in order, whether it was posted without blocking}, and
    the (source, k) of the nonblocking receives posted where they were called (the rest: from the start)."""
    steps, sends, receives, exact, of, completed = [], {}, {}, set(), {}, {}
    for pos, i in waits:
        completed.setdefault(pos, []).append(i)
    waited = {i for _, i in waits}
    for index, c in enumerate([*calls, None]):
        steps.extend(("wait", *of[i]) for i in completed.get(index, []) if i in of)
        if c is None or "probe" in c.name.lower():  # a probe moves nothing
            continue
        dest, source = (x if isinstance(x, int) and 0 <= x < p and x != rank else None for x in (c.dest, c.source))
        if dest is not None:
            k = sends[dest] = sends.get(dest, -1) + 1
            steps.append(("send" if c.name in BLOCKING_SENDS else "post", dest, k))
            of[index] = ("post", dest, k)
        if source is not None:
            mine = receives.setdefault(source, [])
            mine.append(c.name not in BLOCKING_RECEIVES)
            k = len(mine) - 1
            if c.name in BLOCKING_RECEIVES:
                steps.append(("recv", source, k))
                if dest is not None:  # a Sendrecv returns once its send was received too
                    steps.append(("wait", *of[index]))
            elif index in waited:  # noted when called (one from any source is noted when it completes)
                exact.add((source, k))
                steps.append(("irecv", source, k))
                of[index] = ("irecv", source, k)
    return steps, receives, exact


def _counts_agree(steps: tuple, receives: tuple) -> bool:
    """Whether every rank received from each other rank as many messages as that rank sent it: where not
    (a receive the recorder could not see, a message never received), the replay has nothing to say."""
    for r, mine in enumerate(steps):
        sent = [s[1] for s in mine if s[0] in ("send", "post")]
        for peer in set(sent) | {q for q, got in enumerate(receives) if r in got}:
            if sent.count(peer) != len(receives[peer].get(r, [])):
                return False
    return True


def stuck(everyone: list[list], waits: list[list] | None = None) -> dict[int, tuple[str, int]] | None:
    """Replay every rank's recorded calls with sends that wait for their receive: None when all finish, else
    {rank: (where, peer)} where each unfinished rank waits: "send", "recv", "wait-post" (an Isend's Wait) or
    "wait-irecv" (an Irecv's). `everyone`: hooks.gather_calls;
    `waits`: every rank's Context.waits (where its Isends and Irecvs completed), if known."""
    p = len(everyone)
    waits = waits if waits is not None and len(waits) == p else [[] for _ in range(p)]
    steps, receives, exact = zip(*(_steps(calls, r, p, waits[r]) for r, calls in enumerate(everyone))) if p \
        else ((), (), ())
    if not _counts_agree(steps, receives):
        return None
    at, passed, posted, received = [0] * p, {}, {}, {}  # (src, dst) -> sends got past, receives posted, done
    now = lambda r: steps[r][at[r]] if at[r] < len(steps[r]) else None  # noqa: E731

    def receive_posted(src: int, dst: int, k: int) -> bool:
        theirs = receives[dst].get(src, [])
        return (received.get((src, dst), 0) > k
                or k < len(theirs) and theirs[k] and ((src, k) not in exact[dst] or posted.get((src, dst), 0) > k))

    moved = True
    while moved:
        moved = False
        for r in range(p):
            while (step := now(r)) is not None:
                kind, peer, k = step[-3:] if step[0] == "wait" else step
                if step[0] == "wait":
                    if not (receive_posted(r, peer, k) if kind == "post" else passed.get((peer, r), 0) > k):
                        break
                elif kind == "post":
                    passed[(r, peer)] = k + 1
                elif kind == "irecv":
                    posted[(peer, r)] = k + 1
                elif kind == "send":
                    if now(peer) == ("recv", r, k):  # it waits for this very message: both go on
                        at[peer] += 1
                        received[(r, peer)] = k + 1
                    elif not receive_posted(r, peer, k):
                        break
                    passed[(r, peer)] = k + 1
                elif passed.get((peer, r), 0) <= k:  # recv: its message not sent yet
                    if now(peer) != ("send", r, k):
                        break
                    at[peer] += 1
                    passed[(peer, r)] = received[(peer, r)] = k + 1
                else:
                    received[(peer, r)] = k + 1
                at[r] += 1
                moved = True
    left = {r: (f"wait-{now(r)[1]}" if now(r)[0] == "wait" else now(r)[0], now(r)[-2])
            for r in range(p) if now(r) is not None}
    return left or None
