"""The bottom layer: settings, errors, logging, clock and small runtime helpers.

It imports nothing of ours; every other package may import it.
"""
