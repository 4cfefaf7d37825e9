"""juicefs: the fleet's shards on a real distributed file system (JuiceFS over a Redis metadata
engine the fleet owns, a local ``file`` bucket, one FUSE mount per simulated host).

:class:`JuiceFs` is the substrate; the modules beneath it are its parts: ``redis`` (the engine),
``mount`` (format, and one host's client), ``relay`` (a host's link to the engine, which a
partition cuts), ``procs`` and ``binaries`` (helpers), ``errors`` (the error tree).
"""

from fleet_sim.juicefs.errors import (
    BinaryMissing,
    FormatFailed,
    JuiceFsError,
    MetadataFailed,
    MountFailed,
    RelayFailed,
)
from fleet_sim.juicefs.mount import ClientOptions, JuiceFsMount, format_volume
from fleet_sim.juicefs.redis import RedisConfig, RedisServer
from fleet_sim.juicefs.relay import RelayProcess
from fleet_sim.juicefs.substrate import JuiceFs, JuiceFsConfig

__all__ = [
    "BinaryMissing",
    "ClientOptions",
    "FormatFailed",
    "JuiceFs",
    "JuiceFsConfig",
    "JuiceFsError",
    "JuiceFsMount",
    "MetadataFailed",
    "MountFailed",
    "RedisConfig",
    "RedisServer",
    "RelayFailed",
    "RelayProcess",
    "format_volume",
]
