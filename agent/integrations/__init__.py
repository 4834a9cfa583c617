"""Adapters that put the step API (``Guard``, ``guard.step``) inside training frameworks that own
the loop: Lightning / Fabric, Hugging Face Trainer / Accelerate, torchtitan.

Each adapter is its own module and imports its framework only when it is imported itself, so
``import sdcguard`` never pulls a framework in. Install the one you use as an extra, e.g.
``pip install "sdcguard[lightning]"``; the pinned versions are the ones the tests run against.
"""
