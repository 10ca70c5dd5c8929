"""The checkpoint store's bucket side on Cloud Storage."""
