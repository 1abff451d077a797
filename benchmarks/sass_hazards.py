"""Read SASS (nvdisasm's text) for what ptxas let through around asynchronous wgmmas. Apart from
sm90_compile.py, which needs Triton and turns the interpreter off, so that tests can import it."""

from __future__ import annotations

import re

_NO_REGISTER_WRITE = ("ST", "SYNCS.ARRIVE", "BAR", "BRA", "WARPGROUP", "NOP", "RED", "EXIT",
                      "CCTL", "FENCE", "MEMBAR", "UTMA", "ISETP", "PLOP3", "UISETP", "ULDC")


def _instructions(lines: list[str]) -> list[tuple[str, list[str], str]]:
    """(opcode, operands, text) of each SASS instruction line, predicates dropped."""
    out = []
    for line in lines:
        m = re.search(r"/\*[0-9a-f]+\*/\s+(.*?)\s*;", line)
        if m:
            text = m.group(1)
            op, _, rest = re.sub(r"^@!?U?P\w+\s+", "", text).partition(" ")
            out.append((op, [o.strip() for o in rest.split(",")], text))
    return out


def _registers(token: str, width: int) -> set[int]:
    m = re.search(r"\bR(\d+)", token)
    return set(range(int(m.group(1)), int(m.group(1)) + width)) if m else set()


def _width(op: str) -> int:
    """Registers a vector load's destination or a store's data spans."""
    return 4 if ".128" in op else 2 if ".64" in op or ".WIDE" in op else 1


def _touched(op: str, ops: list[str]) -> set[int]:
    """The registers an instruction names, a vector destination's or store's data in full."""
    regs = {r for o in ops for r in _registers(o, 1)}
    if op.startswith("ST"):
        regs |= _registers(ops[-1], _width(op))
    elif not op.startswith(_NO_REGISTER_WRITE) and ops:
        regs |= _registers(ops[0], _width(op))
    return regs


def wgmma_hazards(lines: list[str], cyclic: bool) -> list[str]:
    """Instructions that touch the registers of a wgmma still in flight, its register A operand
    (4 registers an HGMMA) or its accumulator, between the HGMMA and the WARPGROUP.DEPBAR that
    retires its group: PTX leaves that undefined, and ptxas does not always keep a program out
    of it (wint_ws.py's _step and wint_mma.py's retire_each_step say where it did not).
    ``lines`` in address order; ``cyclic``: a loop body, scanned twice so its back edge is
    followed. Branches are not followed otherwise: a straight-line read of the code, for
    checking, not a proof."""
    pending: list[set[int]] = []  # per committed group: A and accumulator registers
    current: set[int] = set()
    found = []
    instructions = _instructions(lines)
    for rnd in range(2 if cyclic else 1):
        for op, ops, text in instructions:
            if op.startswith("HGMMA"):
                n = int(re.match(r"HGMMA\.64x(\d+)", op).group(1))
                current |= _registers(ops[1], 4) | _registers(ops[0], n // 2)
                if ops[-1] == "gsb0":
                    pending.append(current)
                    current = set()
            elif op.startswith("WARPGROUP.DEPBAR"):
                del pending[:max(0, len(pending) - int(ops[-1], 16))]
            elif pending and _touched(op, ops) & set().union(*pending) and (
                    rnd == 1 or not cyclic):
                found.append(text)
    return found
