"""The weight channel's buckets: every tensor once, same-dtype buckets in state-dict order, bounded in size; and a
transfer through a real two-process gloo group (here two threads) reproduces the state dict bit for bit."""

from __future__ import annotations

import threading

import torch
from twinkle_ray.weight_channel import WeightChannel, pack, plan_buckets, unpack


def state() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {"a": torch.randn(10, 4, generator=generator), "b": torch.arange(6, dtype=torch.int64),
            "c": torch.randn(3, generator=generator).to(torch.bfloat16), "d": torch.randn(50, generator=generator),
            "e": torch.randn(2, 2, generator=generator)}


def test_buckets_group_dtypes_in_order_and_respect_the_size():
    buckets = plan_buckets(state(), bucket_bytes=200)  # 50 float32 values: 'd' (200 bytes) fills a bucket alone
    names = [[slot.name for slot in bucket] for bucket in buckets]
    assert sorted(n for bucket in names for n in bucket) == ["a", "b", "c", "d", "e"]
    assert all(len({slot.dtype for slot in bucket}) == 1 for bucket in buckets)
    assert ["d"] in names and all(sum(s.numel for s in b) * 4 <= 200 or len(b) == 1 for b in buckets
                                  if b[0].dtype == "float32")
    whole = state()
    for bucket in buckets:
        assert all(torch.equal(unpack(pack(whole, bucket), bucket)[slot.name], whole[slot.name]) for slot in bucket)


def test_a_transfer_over_the_channel_is_bit_exact():
    sent = state()
    buckets = plan_buckets(sent, bucket_bytes=64)
    receiver = WeightChannel.listen("127.0.0.1", timeout_s=60)
    received: dict[str, torch.Tensor] = {}

    def receive() -> None:
        receiver.connect()
        received.update(receiver.receive(buckets))

    thread = threading.Thread(target=receive)
    thread.start()
    sender = WeightChannel("127.0.0.1", receiver.port, WeightChannel.SENDER, timeout_s=60)
    sender.connect()
    sender.send(sent, buckets)
    thread.join(timeout=60)
    assert len(buckets) > 3 and set(received) == set(sent)
    assert all(torch.equal(received[k], sent[k]) and received[k].dtype == sent[k].dtype for k in sent)
