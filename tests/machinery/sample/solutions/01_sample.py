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

# %%
#| export
#| exercise 1.4
def plus4(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 4
    ### END SOLUTION

# %%
#| export
#| exercise 1.5
def plus5(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 5
    ### END SOLUTION

# %%
#| export
#| exercise 1.6
def plus6(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 6
    ### END SOLUTION

# %%
#| export
#| exercise 1.7
def plus7(x: int) -> int:
    ### BEGIN SOLUTION
    return x + 7
    ### END SOLUTION
