"""One DDP epoch over a shard folder: ``python -m tests.ddp_epoch RECORDS OUT.json RANKS WORKERS``.

Run by tests/test_torch_recipes.py in a fresh interpreter (no TensorFlow, so DataLoader workers may fork). Each
rank trains small-cnn on its share with DistributedDataParallel (gloo) and ``WORKERS`` DataLoader workers; rank 0
writes what every rank read (image names in order, batch counts) to ``OUT.json``. A rank with fewer batches than
the others would leave them waiting in the gradient all-reduce: the epoch would never end.
"""

import json
import os
import sys

import torch
import torch.distributed as dist

from tfpipe.runtime.lifecycle import die_with_parent
from tfpipe.runtime.net import free_port
from tfpipe.torch.dataset import RecordDataset
from train.torch.models import build_model, model_inputs

BATCH = 4


def rank_epoch(rank, records, out, ranks, workers, port, parent):
    die_with_parent(parent)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=ranks)
    ds = RecordDataset(records, shuffle=True, with_ids=True, batch_size=BATCH)  # rank and world from dist
    loader = torch.utils.data.DataLoader(ds, batch_size=BATCH, num_workers=workers, persistent_workers=True)
    model = torch.nn.parallel.DistributedDataParallel(build_model("small-cnn", ds.num_classes))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    seen = {}
    for epoch in range(2):
        ds.set_epoch(epoch)
        names, batches = [], 0
        for images, targets, batch_names in loader:
            loss = torch.nn.functional.binary_cross_entropy_with_logits(model(model_inputs(images, True)), targets)
            loss.backward()  # the all-reduce every rank must join
            optimizer.step()
            optimizer.zero_grad()
            names += batch_names
            batches += 1
        seen[epoch] = {"names": names, "batches": batches, "len_loader": len(loader)}
    everyone = [None] * ranks
    dist.all_gather_object(everyone, seen)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(everyone, f)
    dist.destroy_process_group()


def main(records, out, ranks, workers):
    port = free_port()
    args = (records, out, int(ranks), int(workers), port, os.getpid())
    torch.multiprocessing.spawn(rank_epoch, args=args, nprocs=int(ranks))


if __name__ == "__main__":
    main(*sys.argv[1:])
