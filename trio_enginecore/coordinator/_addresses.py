"""Where a coordinator listens."""

from __future__ import annotations

import attrs

__all__ = ["CoordinatorAddresses"]


@attrs.frozen
class CoordinatorAddresses:
    """Where a coordinator listens: the three addresses it binds.

    Attributes:
        stats: engines PUSH their counts and wave reports here.
        engine_publish: engines subscribe here for START_DP_WAVE.
        publish: clients subscribe here for the counts and the wave.
    """

    stats: str
    engine_publish: str
    publish: str

    @classmethod
    def on_host(cls, host: str) -> CoordinatorAddresses:
        """TCP addresses on ``host`` with ports chosen when bound."""
        return cls(
            stats=f"tcp://{host}:*", engine_publish=f"tcp://{host}:*", publish=f"tcp://{host}:*"
        )

    @classmethod
    def in_directory(cls, directory: str) -> CoordinatorAddresses:
        """ipc:// addresses in ``directory`` (which should be private, mode 0700)."""
        return cls(
            stats=f"ipc://{directory}/coordinator-stats",
            engine_publish=f"ipc://{directory}/coordinator-engines",
            publish=f"ipc://{directory}/coordinator-publish",
        )

    def arguments(self) -> list[str]:
        """The ``trio-enginecore coordinator`` flags for these addresses."""
        return [
            "--stats-address",
            self.stats,
            "--engine-publish-address",
            self.engine_publish,
            "--publish-address",
            self.publish,
        ]
