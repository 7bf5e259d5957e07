"""Run under a launcher (mpiexec or torchrun): exercises every Comm collective with uneven
counts and checks the answers against closed forms. Prints 'rank R ok' per rank."""

import sys

import torch

from scalelab.comm.base import even_counts
from scalelab.comm.mpi import MPIComm
from scalelab.comm.torchdist import TorchDistComm

comm = MPIComm() if sys.argv[1] == "mpi" else TorchDistComm(sys.argv[1])
rank, size = comm.rank, comm.size

# scatterv: 2*size+1 rows (uneven), row i holds i in every element; bf16 travels as bytes.
n = 2 * size + 1
counts = even_counts(n, size)
full = torch.arange(n, dtype=torch.bfloat16)[:, None].repeat(1, 3) if rank == 0 else None
mine = comm.scatterv(full, counts)
first = sum(counts[:rank])
assert mine.dtype == torch.bfloat16 and mine.shape == (counts[rank], 3), mine.shape
assert torch.equal(mine[:, 0].float(), torch.arange(first, first + counts[rank]).float())

# gatherv: every rank sends rank+1 rows of value rank (uint8); root sees them in rank order.
part = torch.full((rank + 1, 2), rank, dtype=torch.uint8)
got = comm.gatherv(part)
if rank == 0:
    want = torch.cat([torch.full((r + 1, 2), r, dtype=torch.uint8) for r in range(size)])
    assert torch.equal(got.cpu(), want)
else:
    assert got is None

# allreduce: sum of (rank+1) over ranks = size(size+1)/2; max = size.
x = torch.full((4,), float(rank + 1), dtype=torch.float64)
assert torch.all(comm.allreduce(x.clone()) == size * (size + 1) / 2)
assert torch.all(comm.allreduce(x.clone(), op="max") == size)

# bcast from the last rank.
b = comm.bcast(torch.arange(5, dtype=torch.int64) * 7 if rank == size - 1 else None, root=size - 1)
assert torch.equal(b.cpu(), torch.arange(5) * 7)

# ring exchange with non-blocking point-to-point.
right, left = (rank + 1) % size, (rank - 1) % size
buf = torch.empty(3, dtype=torch.float32)
reqs = [comm.irecv(buf, left, tag=5), comm.isend(torch.full((3,), float(rank)), right, tag=5)]
for r in reqs:
    r.wait()
assert torch.all(buf == left), (rank, buf)

phases = comm.gather_object({"rank": rank})
assert rank != 0 or [p["rank"] for p in phases] == list(range(size))
comm.barrier()
print(f"rank {rank} ok", flush=True)
comm.close()
