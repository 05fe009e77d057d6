"""CRIU: ``options`` turns typed options into argv, ``runner`` runs CRIU and reads its logs."""
