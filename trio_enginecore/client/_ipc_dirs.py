"""Private directories for ipc:// sockets: re-exported from :mod:`trio_enginecore._ipc_dirs`,
where they moved so that the coordinator, which is no client, can use them too."""

from __future__ import annotations

from .._ipc_dirs import (
    OWNER_FILE as OWNER_FILE,
    DirectoryOwner as DirectoryOwner,
    private_ipc_dir as private_ipc_dir,
    remove_stale_ipc_dirs as remove_stale_ipc_dirs,
)

__all__ = ["OWNER_FILE", "DirectoryOwner", "private_ipc_dir", "remove_stale_ipc_dirs"]
