# The grading container: an optional recipe, where Docker exists (grading never needs it).
#
#   docker build -f course/grading.Dockerfile -t minitorch-grader .
#   docker run --rm --network none -v "$PWD/handed_in:/submissions:ro" -v "$PWD/build/grades:/grades" \
#       minitorch-grader --lessons 03 [--deadline ... --late ...]
#
# It runs `make grade-class`'s grader (course/classgrade.py) as root in the container. Docker's default
# seccomp profile forbids the namespaces course/isolation.py prefers, so it uses its uid mode: each
# student's code runs as the user `mtstudent`, with no_new_privs, its processes and temporary files
# cleared after each run, and this checkout (/course, mode 700) and the grading trees out of its reach;
# `--network none` cuts the network, which that mode does not. (`docker run --privileged` would allow the
# namespaces mode instead, at the price of a privileged container.) The container holds no GPU: the GPU
# tests skip, as on any machine without one.
FROM python:3.12-slim-bookworm

RUN apt-get update \
    && apt-get install -y --no-install-recommends g++ make git util-linux \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --no-create-home --shell /usr/sbin/nologin mtstudent

# The course's packages, CPU only (no `gpu` extra), in a venv every user can read.
COPY pyproject.toml constraints.txt /tmp/course/
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('/tmp/course/pyproject.toml', 'rb'))['project']['dependencies']))" \
        > /tmp/course/requirements.txt \
    && python -m venv /opt/venv \
    && /opt/venv/bin/pip install --no-cache-dir -q -c /tmp/course/constraints.txt -r /tmp/course/requirements.txt \
    && chmod -R a+rX /opt/venv /usr/local/lib/python3.12

# The checkout (solutions/ and every answer in minitorch/): readable by root alone.
COPY pyproject.toml constraints.txt setup.py .gitignore /course/
COPY course /course/course
COPY solutions /course/solutions
COPY tests /course/tests
COPY lessons /course/lessons
COPY minitorch /course/minitorch
COPY data /course/data
COPY hardware_notes /course/hardware_notes
RUN chmod 700 /course
WORKDIR /course

ENTRYPOINT ["sh", "-c", "export MT_SANDBOX_UID=$(id -u mtstudent); exec /opt/venv/bin/python -m course.classgrade /submissions --out /grades \"$@\"", "grade"]
CMD ["--help"]
