# %% [markdown]
# # Lesson 01: a sample lesson for the machinery's own tests

# %%
#| default_exp sample
#| export
import math

import numpy as np

# %%
from course.check import check

# %%
#| export
#| exercise 1.1
def double(x: float) -> float:
    """Twice x."""
    ### BEGIN SOLUTION
    return 2 * x
    ### END SOLUTION

# %% tags=["check"]
check("1.1")

# %%
#| export
#| exercise 1.2
class Circle:
    def __init__(self, r: float):
        self.r = r

    def area(self) -> float:
        """pi r^2."""
        ### BEGIN SOLUTION
        return math.pi * self.r**2
        ### END SOLUTION

# %% tags=["check"]
check("1.2")

# %% tags=["demo"]
print(Circle(1.0).area())

# %% [markdown]
# Five more one-line exercises, so one grading run can break each in a different way.

# %%
#| export
#| exercise 1.3
def plus3(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 3
    ### END SOLUTION

# %% tags=["check"]
check("1.3")

# %%
#| export
#| exercise 1.4
def plus4(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 4
    ### END SOLUTION

# %% tags=["check"]
check("1.4")

# %%
#| export
#| exercise 1.5
def plus5(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 5
    ### END SOLUTION

# %% tags=["check"]
check("1.5")

# %%
#| export
#| exercise 1.6
def plus6(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 6
    ### END SOLUTION

# %% tags=["check"]
check("1.6")

# %%
#| export
#| exercise 1.7
def plus7(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 7
    ### END SOLUTION

# %% tags=["check"]
check("1.7")

# %% [markdown]
# Three more, for the ways a notebook can break that a signal cannot catch.

# %%
#| export
#| exercise 1.8
def plus8(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 8
    ### END SOLUTION

# %% tags=["check"]
check("1.8")

# %%
#| export
#| exercise 1.9
def plus9(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 9
    ### END SOLUTION

# %% tags=["check"]
check("1.9")

# %%
#| export
#| exercise 1.10
def plus10(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 10
    ### END SOLUTION

# %% tags=["check"]
check("1.10")

# %% [markdown]
# Two exercises for the feedback a failure gives: whole arrays, notes, the line that raised, the
# call that should have raised, the function that failed.

# %%
#| export
#| exercise 1.11
def causal_mask(n: int) -> np.ndarray:
    """n x n boolean mask: True where query i may attend key j (j <= i)."""
    ### BEGIN SOLUTION
    return np.tril(np.ones((n, n), dtype=bool))
    ### END SOLUTION

# %% tags=["check"]
check("1.11")

# %%
#| export
#| exercise 1.12
def _positive(n: int) -> int:
    """n, or ValueError for a negative n (given code: the student's line is the call)."""
    if n < 0:
        raise ValueError(f"a size must be >= 0, got {n}")
    return n


def cache_bytes(layers: int, tokens: int) -> int:
    """Bytes of a toy cache; ValueError for a negative size."""
    ### BEGIN SOLUTION
    return 2 * _positive(layers) * _positive(tokens)
    ### END SOLUTION


def fork(blocks: list[int]) -> list[int]:
    """A new block table sharing the same blocks."""
    ### BEGIN SOLUTION
    return list(blocks)
    ### END SOLUTION

# %% tags=["check"]
check("1.12")
