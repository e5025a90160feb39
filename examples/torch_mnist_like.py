"""A Horovod-style training script (MNIST-shaped synthetic data, no downloads).

Ported from the usual Horovod PyTorch MNIST example: the only change is the import line.

    mpirun -np 2 python examples/torch_mnist_like.py
    horovodrun -np 2 python examples/torch_mnist_like.py
"""
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F

import hybridsync.torch as hvd  # was: import horovod.torch as hvd  (the one line a port changes)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 8, kernel_size=5)
        self.conv2 = nn.Conv2d(8, 16, kernel_size=5)
        self.fc1 = nn.Linear(256, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2(x), 2))
        x = F.relu(self.fc1(x.flatten(1)))
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(n, seed):
    """Images whose label is decided by a fixed random 'teacher' net, so the task is learnable."""
    g = torch.Generator().manual_seed(seed)
    images = torch.randn(n, 1, 28, 28, generator=g)
    torch.manual_seed(1234)
    teacher = Net()
    with torch.no_grad():
        labels = teacher(images).argmax(dim=1)
    return images, labels


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--lr", type=float, default=0.01)
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args()

    hvd.init()
    torch.manual_seed(42)
    torch.set_num_threads(1)

    images, labels = synthetic_mnist(args.samples, seed=7)
    # Each rank trains on its own slice of the data, as DistributedSampler would give it.
    images, labels = images[hvd.rank()::hvd.size()], labels[hvd.rank()::hvd.size()]

    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * hvd.size(), momentum=0.5)
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=hvd.Compression.none)

    for epoch in range(args.epochs):
        model.train()
        total = torch.zeros(2)
        for start in range(0, len(images), args.batch_size):
            x, y = images[start:start + args.batch_size], labels[start:start + args.batch_size]
            optimizer.zero_grad()
            loss = F.nll_loss(model(x), y)
            loss.backward()
            optimizer.step()
            total += torch.tensor([loss.item() * len(x), len(x)])
        total = hvd.allreduce(total, op=hvd.Sum, name="epoch_loss")
        if hvd.rank() == 0:
            print(f"epoch {epoch}: mean train loss {total[0] / total[1]:.4f}\n", end="", flush=True)


if __name__ == "__main__":
    main()
