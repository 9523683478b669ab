"""The actions of torch's pipelining CSV that both of its readers know: the largest stage
or microbatch index a cell may name, and the transfer actions with their peers.
"""

from __future__ import annotations

from ..ir import ACT, GRAD

MAX_INDEX = 10**6
COMMS = ("SEND_F", "SEND_B", "RECV_F", "RECV_B")
PEER = {"SEND_F": (1, ACT, True), "SEND_B": (-1, GRAD, True),  # peer offset, kind, is send
        "RECV_F": (-1, ACT, False), "RECV_B": (1, GRAD, False)}
