"""The written fabric interface (swarm/fabric/interface.py): both transports implement every method
with the Protocol's own signature, and each real fabric passes the runtime check."""

import inspect

import pytest

from swarm.fabric import interface
from swarm.fabric.grpc.fabric import GrpcFabric
from swarm.fabric.grpc.weights import GrpcWeightClient
from swarm.fabric.grpc.rollouts import GrpcRolloutSender
from swarm.fabric.grpc.registry import GrpcBootstrap
from swarm.fabric.hivemind.fabric import HivemindBootstrap, HivemindFabric
from swarm.fabric.hivemind.rollouts import RolloutSender
from swarm.fabric.hivemind.weights import WeightClient


def protocol_members(protocol) -> dict:
    return {name: value for name, value in vars(protocol).items()
            if not name.startswith("_") and (callable(value) or isinstance(value, property))}


def parameters(member) -> list[tuple[str, object]]:
    fn = member.fget if isinstance(member, property) else member
    return [(p.name, p.kind) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("protocol, implementations", [
    (interface.Fabric, [HivemindFabric, GrpcFabric]),
    (interface.BootstrapNode, [HivemindBootstrap, GrpcBootstrap]),
    (interface.RolloutSender, [RolloutSender, GrpcRolloutSender]),
    (interface.WeightClient, [WeightClient, GrpcWeightClient]),
])
def test_both_transports_implement_the_protocol_with_its_signatures(protocol, implementations):
    members = protocol_members(protocol)
    assert members, protocol
    for cls in implementations:
        for name, member in members.items():
            assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
            theirs = inspect.getattr_static(cls, name)
            assert isinstance(theirs, property) == isinstance(member, property), f"{cls.__name__}.{name}: property or method"
            assert parameters(theirs) == parameters(member), f"{cls.__name__}.{name} has another signature than {protocol.__name__}'s"


def test_real_fabrics_are_fabrics(make_fabric):
    fabric = make_fabric()
    assert isinstance(fabric, interface.Fabric) and fabric.transport == make_fabric.transport
    assert fabric.now() > 0 and fabric.addresses()
