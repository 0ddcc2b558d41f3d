"""Settings package: ``base`` (shared), ``local`` (``make up``), ``test``, ``production``."""
