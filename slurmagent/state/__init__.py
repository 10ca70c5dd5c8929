"""Files on this node, each with one reader/writer module."""
