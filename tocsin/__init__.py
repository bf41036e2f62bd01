"""Tocsin: a Kafka-native distributed scheduler with an HTTP delivery proxy.

Package map (see README): ``topics`` is the wire contract, ``streams`` the scheduler,
``proxy`` delivery, ``schema`` the Cassandra and message schemas; this package holds what
they share at the edges: settings, errors, logging, the local stack and the command line.
"""

__version__ = "0.1.0"
