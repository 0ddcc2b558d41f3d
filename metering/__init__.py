"""Metering: what the fleet served, per request (``request_log``) and per hour (``usage``).

Facts only, no money: the usage pipeline writes here from Kafka ``usage.v1``; billing
prices these rows and customers read them through the usage API.
"""
