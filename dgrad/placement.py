"""Mapping pipeline stages onto devices.

>>> import jax
>>> place_stages(4, [jax.devices()[0]]) == [jax.devices()[0]] * 4
True
"""

from __future__ import annotations

from typing import Sequence

import jax

PLACEMENTS = ("spread", "one_per_device")

_FAKE_DEVICES_HINT = (
    "On a CPU-only machine, ask for fake devices before JAX starts: "
    "XLA_FLAGS=--xla_force_host_platform_device_count=N, or "
    "jax.config.update('jax_num_cpu_devices', N) right after `import jax`."
)


def place_stages(
    num_stages: int,
    devices: Sequence[jax.Device] | None = None,
    placement: str | Sequence[int] = "spread",
) -> list[jax.Device]:
    """Returns the device of each stage.

    Args:
      num_stages: K.
      devices: the devices to use; defaults to `jax.devices()`.
      placement: `"spread"` puts contiguous runs of stages on each device (K
        stages on D devices: stage k on device k*D//K; with K <= D, stage k on
        device k); `"one_per_device"` puts stage k on `devices[k]` and needs at
        least K devices; a sequence of K integers names each stage's device by
        its index into `devices`.
    """
    devices = list(jax.devices() if devices is None else devices)
    if not devices:
        raise ValueError("devices is empty; pass at least one device or None for jax.devices().")
    for device in devices:
        if not isinstance(device, jax.Device):
            raise TypeError(
                f"devices must hold jax.Device objects (from jax.devices()), got {device!r}."
            )
    if isinstance(placement, str):
        if placement == "spread":
            used = min(len(devices), num_stages)
            return [devices[k * used // num_stages] for k in range(num_stages)]
        if placement == "one_per_device":
            if len(devices) < num_stages:
                raise ValueError(
                    f"placement='one_per_device' needs {num_stages} devices for {num_stages} "
                    f"stages, got {len(devices)}. Pass more devices, or placement='spread' to "
                    f"share devices between stages. {_FAKE_DEVICES_HINT}"
                )
            return devices[:num_stages]
        raise ValueError(
            f"Unknown placement {placement!r}; use one of {PLACEMENTS} or a list of "
            "device indices, one per stage."
        )
    indices = list(placement)
    if len(indices) != num_stages:
        raise ValueError(
            f"placement lists {len(indices)} device indices for {num_stages} stages; "
            "give exactly one per stage."
        )
    for index in indices:
        if isinstance(index, bool) or not isinstance(index, int) or not 0 <= index < len(devices):
            raise ValueError(
                f"placement index {index!r} is not a valid index into {len(devices)} devices."
            )
    return [devices[i] for i in indices]
