# %% [markdown]
# # Lesson 01: a sample lesson for the machinery's own tests

# %%
#| default_exp sample
#| export
import math

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
