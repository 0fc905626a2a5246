"""Moved to :mod:`tracerl.events.hookspecs`; this import path stays for plugins written before."""

from ..events.hookspecs import HOOKSPEC_VERSION, PROJECT, hookimpl, hookspec

__all__ = ["HOOKSPEC_VERSION", "PROJECT", "hookimpl", "hookspec"]
