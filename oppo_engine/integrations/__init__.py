"""Adapters that let existing RL trainers take their rollouts from a ``RolloutEngine``.

Each adapter is its own module with its own optional dependency (``oppo_engine.integrations.trl`` needs
the ``trl`` extra: ``pip install 'oppo_engine[trl]'``); importing this package imports none of them.
"""
