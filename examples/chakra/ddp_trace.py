"""Write a DDP-like Chakra execution trace with Chakra's own schema and writer: each of N ranks
computes, all-reduces a gradient bucket as soon as it is ready, computes again, and so on.

    .venv/bin/python examples/chakra/ddp_trace.py /tmp/ddp --ranks 4 --buckets 1MiB,4MiB
    sudo .venv/bin/testbed replay /tmp/ddp --algo ring --time-dilation 4
"""

import argparse
import re

from chakra.schema.protobuf import et_def_pb2 as pb
from chakra.src.third_party.utils.protolib import encodeMessage


def size(text: str) -> int:
    m = re.fullmatch(r"(\d+)\s*(|KiB|MiB|GiB)", text.strip())
    if not m:
        raise argparse.ArgumentTypeError(f"{text!r}: give bytes or NKiB/NMiB/NGiB")
    return int(m.group(1)) << {"": 0, "KiB": 10, "MiB": 20, "GiB": 30}[m.group(2)]


def node(i: int, name: str, kind, deps, **fields) -> pb.Node:
    return pb.Node(id=i, name=name, type=kind, data_deps=list(deps), **fields)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("prefix", help="writes PREFIX.0.et ... PREFIX.<ranks-1>.et")
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--buckets", default="1MiB,4MiB", help="allreduce sizes, comma-separated")
    ap.add_argument("--compute-us", type=int, default=20_000, help="compute before each")
    args = ap.parse_args()
    buckets = [size(b) for b in args.buckets.split(",")]
    for rank in range(args.ranks):
        with open(f"{args.prefix}.{rank}.et", "wb") as f:
            encodeMessage(f, pb.GlobalMetadata(version="0.0.4"))
            prev: list[int] = []
            for k, nbytes in enumerate(buckets):
                c = node(10 * k + 1, f"backward{k}", pb.COMP_NODE, prev,
                         duration_micros=args.compute_us)
                a = node(10 * k + 2, f"allreduce{k}", pb.COMM_COLL_NODE, [c.id])
                a.attr.append(pb.AttributeProto(name="comm_type", int64_val=pb.ALL_REDUCE))
                a.attr.append(pb.AttributeProto(name="comm_size", int64_val=nbytes))
                encodeMessage(f, c)
                encodeMessage(f, a)
                prev = [a.id]
            encodeMessage(f, node(99, "optimizer", pb.COMP_NODE, prev,
                                  duration_micros=args.compute_us))
    print(f"wrote {args.prefix}.0.et .. {args.prefix}.{args.ranks - 1}.et")


if __name__ == "__main__":
    main()
