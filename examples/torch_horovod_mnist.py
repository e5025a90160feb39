"""Horovod's PyTorch MNIST example, as a Horovod user wrote it: argument parsing, one CPU thread
per worker, DistributedSampler shards, the learning rate scaled by the world size, rank 0's
model and optimizer broadcast, DistributedOptimizer with its Horovod options, and test metrics
averaged with named all-reduces. Only two things differ from the original: the import line, and
synthetic MNIST-shaped data (labels from a fixed random teacher network) instead of a download.

    mpirun -np 2 python examples/torch_horovod_mnist.py --epochs 3
    horovodrun -np 2 python examples/torch_horovod_mnist.py --fp16-allreduce
"""
import argparse

import torch
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F
import torch.optim as optim
import torch.utils.data.distributed

import hybridsync.torch as hvd  # was: import horovod.torch as hvd

parser = argparse.ArgumentParser(description="PyTorch MNIST example (synthetic data)")
parser.add_argument("--batch-size", type=int, default=64, metavar="N", help="input batch size for training")
parser.add_argument("--test-batch-size", type=int, default=1000, metavar="N", help="input batch size for testing")
parser.add_argument("--epochs", type=int, default=10, metavar="N", help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.01, metavar="LR", help="learning rate")
parser.add_argument("--momentum", type=float, default=0.5, metavar="M", help="SGD momentum")
parser.add_argument("--no-cuda", action="store_true", default=False, help="disables CUDA training")
parser.add_argument("--seed", type=int, default=42, metavar="S", help="random seed")
parser.add_argument("--log-interval", type=int, default=10, metavar="N", help="batches between training logs")
parser.add_argument("--fp16-allreduce", action="store_true", default=False, help="use fp16 compression for allreduce")
parser.add_argument("--use-adasum", action="store_true", default=False, help="use adasum algorithm for reduction")
parser.add_argument("--gradient-predivide-factor", type=float, default=1.0,
                    help="apply gradient predivide factor in optimizer")
parser.add_argument("--train-samples", type=int, default=6000, help="synthetic training images")
parser.add_argument("--test-samples", type=int, default=1000, help="synthetic test images")


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv1 = nn.Conv2d(1, 10, kernel_size=5)
        self.conv2 = nn.Conv2d(10, 20, kernel_size=5)
        self.conv2_drop = nn.Dropout2d()
        self.fc1 = nn.Linear(320, 50)
        self.fc2 = nn.Linear(50, 10)

    def forward(self, x):
        x = F.relu(F.max_pool2d(self.conv1(x), 2))
        x = F.relu(F.max_pool2d(self.conv2_drop(self.conv2(x)), 2))
        x = x.view(-1, 320)
        x = F.relu(self.fc1(x))
        x = F.dropout(x, training=self.training)
        return F.log_softmax(self.fc2(x), dim=1)


def synthetic_mnist(samples, seed):
    """MNIST-shaped images: one fixed random 28x28 template per digit plus strong noise, so the
    ten balanced classes are learnable but not at once -- and nothing is downloaded."""
    templates = torch.randn(10, 1, 28, 28, generator=torch.Generator().manual_seed(1234))
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    images = templates[labels] + torch.randn(samples, 1, 28, 28, generator=generator)
    return torch.utils.data.TensorDataset(images, labels)


def train(epoch):
    model.train()
    # Horovod: a different shuffle of the shards every epoch.
    train_sampler.set_epoch(epoch)
    for batch_idx, (data, target) in enumerate(train_loader):
        if args.cuda:
            data, target = data.cuda(), target.cuda()
        optimizer.zero_grad()
        output = model(data)
        loss = F.nll_loss(output, target)
        loss.backward()
        optimizer.step()
        if batch_idx % args.log_interval == 0:
            # Horovod: len(train_sampler) is this worker's share of the data.
            print(f"Train Epoch: {epoch} [{batch_idx * len(data)}/{len(train_sampler)} "
                  f"({100.0 * batch_idx / len(train_loader):.0f}%)]\tLoss: {loss.item():.6f}", flush=True)


def metric_average(val, name):
    # Horovod: a named all-reduce averages a metric over workers.
    return hvd.allreduce(torch.tensor(val), name=name).item()


def test():
    model.eval()
    test_loss, test_accuracy = 0.0, 0.0
    with torch.no_grad():
        for data, target in test_loader:
            if args.cuda:
                data, target = data.cuda(), target.cuda()
            output = model(data)
            test_loss += F.nll_loss(output, target, reduction="sum").item()
            pred = output.argmax(dim=1, keepdim=True)
            test_accuracy += pred.eq(target.view_as(pred)).cpu().float().sum().item()
    # Horovod: average over this worker's samples, then over workers.
    test_loss = metric_average(test_loss / len(test_sampler), "avg_loss")
    test_accuracy = metric_average(test_accuracy / len(test_sampler), "avg_accuracy")
    if hvd.rank() == 0:
        print(f"\nTest set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%\n", flush=True)


if __name__ == "__main__":
    args = parser.parse_args()
    args.cuda = not args.no_cuda and torch.cuda.is_available()

    # Horovod: initialize the library.
    hvd.init()
    torch.manual_seed(args.seed)
    if args.cuda:
        # Horovod: one GPU per process, chosen by local rank.
        torch.cuda.set_device(hvd.local_rank())
        torch.cuda.manual_seed(args.seed)

    # Horovod: limit the number of CPU threads each worker uses.
    torch.set_num_threads(1)
    kwargs = {"num_workers": 1, "pin_memory": True} if args.cuda else {}
    # Forked data loader workers can crash with some MPI libraries: prefer forkserver.
    if kwargs.get("num_workers", 0) > 0 and "forkserver" in mp.get_all_start_methods():
        kwargs["multiprocessing_context"] = "forkserver"

    train_dataset = synthetic_mnist(args.train_samples, seed=7)
    # Horovod: DistributedSampler gives each worker its own shard.
    train_sampler = torch.utils.data.distributed.DistributedSampler(train_dataset, num_replicas=hvd.size(),
                                                                    rank=hvd.rank())
    train_loader = torch.utils.data.DataLoader(train_dataset, batch_size=args.batch_size, sampler=train_sampler,
                                               **kwargs)
    test_dataset = synthetic_mnist(args.test_samples, seed=8)
    test_sampler = torch.utils.data.distributed.DistributedSampler(test_dataset, num_replicas=hvd.size(),
                                                                   rank=hvd.rank())
    test_loader = torch.utils.data.DataLoader(test_dataset, batch_size=args.test_batch_size, sampler=test_sampler,
                                              **kwargs)

    model = Net()
    # Adasum needs no learning-rate scaling; averaging does (by workers, or GPUs per node with NCCL).
    lr_scaler = hvd.size() if not args.use_adasum else 1
    if args.cuda:
        model.cuda()
        if args.use_adasum and hvd.nccl_built():
            lr_scaler = hvd.local_size()

    # Horovod: scale the learning rate by lr_scaler.
    optimizer = optim.SGD(model.parameters(), lr=args.lr * lr_scaler, momentum=args.momentum)

    # Horovod: every worker starts from rank 0's weights and optimizer state.
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    hvd.broadcast_optimizer_state(optimizer, root_rank=0)

    # Horovod: (optional) compression algorithm.
    compression = hvd.Compression.fp16 if args.fp16_allreduce else hvd.Compression.none

    # Horovod: wrap the optimizer with DistributedOptimizer.
    optimizer = hvd.DistributedOptimizer(optimizer, named_parameters=model.named_parameters(),
                                         compression=compression,
                                         op=hvd.Adasum if args.use_adasum else hvd.Average,
                                         gradient_predivide_factor=args.gradient_predivide_factor)

    for epoch in range(1, args.epochs + 1):
        train(epoch)
        test()
