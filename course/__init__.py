"""Course machinery: build (solutions -> lessons + minitorch), load, grade, check."""
