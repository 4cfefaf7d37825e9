"""The leasefs error tree.

Errors that leasefs raises on purpose in the calling process (the control client and the mount
helper) derive from :class:`LeaseFsError`::

    LeaseFsError
    ├── FuseUnavailable    /dev/fuse or fusermount3 is missing, so no mount can be made
    ├── MountFailed        the daemon exited or never mounted within its start budget
    └── ControlError       the control socket refused, timed out or answered with an error

Inside the daemon, failures are errno values handed back to the kernel (``OSError``), never these
classes: a filesystem call can only ever answer with an errno.
"""

from __future__ import annotations


class LeaseFsError(Exception):
    """Base of every deliberate leasefs error."""


class FuseUnavailable(LeaseFsError):
    """The machine cannot mount FUSE filesystems."""


class MountFailed(LeaseFsError):
    """The daemon did not come up, or did not mount, within its budget."""


class ControlError(LeaseFsError):
    """The control channel failed or the daemon rejected the request."""
