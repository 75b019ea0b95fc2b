"""The client SDK (:mod:`sandbox.sdk.client`): ``from sandbox.sdk import AsyncSandbox, Sandbox``."""

from sandbox.sdk.client import *  # noqa: F403  (the SDK's public names, its __all__)
from sandbox.sdk.client import __all__  # noqa: F401
