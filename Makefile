# Every target sets up the virtual environment first if it is missing (pinned versions).
# `make` alone lists the targets by who uses them (help). A target's line ending in `## who: what | settings`
# is its entry in that list: give a new target one (tests/machinery/test_make_help.py checks).
.DEFAULT_GOAL := help
FORCE   ?=

.PHONY: help setup lab build test check browser browser-test demo bench gpucheck gpu-report clean release grade-class gradescope slides serve cluster site site-test site-serve

# >>> student Makefile: `make release` copies the lines from here to the next "# <<<" into a class's Makefile
PY      := .venv/bin/python
STAMP   := .venv/.installed
L       ?=
# Notebooks started by `make lab` and `make demo` give NumPy's BLAS this many threads. One:
# lessons 01-04 multiply small matrices, where threads only wait for each other (lesson 03
# measures it); lessons 04-06 set the count themselves where they compare with a threaded BLAS.
BLAS_THREADS ?= 1

# The Python that creates .venv (3.11-3.13): `make setup PYTHON=python3.12` to choose another.
PYTHON ?= python3
# One constraints file for every platform: pins that differ carry environment markers.
CONSTRAINTS := constraints.txt
# GPU=0: no `gpu` extra (CuPy, NVRTC): the PTX checks of CUDA C (lessons 08-10, 14) then skip, saying why.
GPU ?= 1

setup: $(STAMP) ## student: create .venv with the pinned versions (any target does) | PYTHON=python3 GPU=0

# A progress line and the result; pip's full output goes to build/setup.log.
$(STAMP): pyproject.toml $(CONSTRAINTS)
	@$(PYTHON) course/setup_venv.py .venv $(CONSTRAINTS) $(if $(filter 0,$(GPU)),--cpu)
	@touch $(STAMP)

# Run as root (a container, many cloud machines), JupyterLab refuses to start without --allow-root.
ALLOW_ROOT := $(if $(filter 0,$(shell id -u)),--allow-root)

lab: $(STAMP) ## student: open JupyterLab on the lessons | BLAS_THREADS=1 LAB_ARGS=...
	OPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) .venv/bin/jupyter lab --ServerApp.root_dir="$(CURDIR)" --LabApp.default_url=/lab/tree/lessons $(ALLOW_ROOT) $(LAB_ARGS)

test: $(STAMP) ## student: grade your saved notebooks, print a scoreboard | L=NN
	$(PY) -m course.grade $(L)
# <<< student Makefile

build: $(STAMP) ## maintainer: generate lessons/ and minitorch/ from solutions/ | FORCE=1
	$(PY) -m course.build $(if $(FORCE),--force)

# Maintainers: the browser test's Python package (Playwright; the browser is the system's Chromium).
BROWSER_STAMP := .venv/.browser
$(BROWSER_STAMP): $(STAMP)
	@mkdir -p build && $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[browser]" > build/setup-browser.log 2>&1 || \
		(cat build/setup-browser.log; exit 1)
	@touch $(BROWSER_STAMP)

# The website's packages (the `site` extra: Sphinx, MyST-NB, sphinx-book-theme, MathJax), installed on first use.
SITE_STAMP := .venv/.site
$(SITE_STAMP): $(STAMP)
	@mkdir -p build && $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[site]" > build/setup-site.log 2>&1 || \
		(cat build/setup-site.log; exit 1)
	@touch $(SITE_STAMP)

check: $(STAMP) $(BROWSER_STAMP) $(SITE_STAMP) ## maintainer: prove every lesson, notebook and the machinery (what CI runs) | L=NN
	$(PY) -m course.maintain check $(L)

# Run All on every stub notebook in JupyterLab in Chromium (make check does four lessons of each
# kind and one solution notebook). `make browser` is its old name.
browser-test: $(STAMP) $(BROWSER_STAMP) ## maintainer: Run All of every stub notebook in JupyterLab in Chromium | L=NN
	$(PY) -m course.browser $(L)

browser: browser-test ## alias

demo: $(STAMP) ## lecturer: execute lesson L's solution at full size into build/demo/ | L=NN BLAS_THREADS=1
	@test -n "$(L)" || (echo "usage: make demo L=05" && exit 2)
	OPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) $(PY) -m course.maintain demo $(L)

# Instructors: a repository for the class, lessons up to UPTO, the answers of FROM..UPTO withheld (FROM
# defaults to UPTO, UPTO to the first lesson). DEST holding an earlier release: one more commit (students
# pull it). GRADER=dir: the private grading repository the Classroom workflow grades with.
release: $(STAMP) ## instructor: a class repository, lessons to UPTO, FROM..UPTO withheld | DEST=dir UPTO=NN FROM=NN GRADER=dir POINTS=file
	@test -n "$(DEST)" || (echo "usage: make release DEST=dir [FROM=NN] [UPTO=NN] [GRADER=dir] [POINTS=file]" && exit 2)
	$(PY) -m course.release "$(DEST)" $(if $(UPTO),--upto $(UPTO)) $(if $(FROM),--from $(FROM)) \
		$(if $(GRADER),--grader "$(GRADER)") $(if $(POINTS),--points "$(POINTS)")

# Instructors: grade exactly the lessons named, one folder per student (or Canvas's flat download), each
# lesson in its grading tree, the students' code isolated (course/isolation.py) -> build/grades/.
OUT ?= build/grades
ISOLATION ?= auto
grade-class: $(STAMP) ## instructor: grade handed-in notebooks, isolated -> build/grades/ | SUBMISSIONS=dir LESSONS=01,02 [FROM OUT ISOLATION POINTS PARTIAL DEADLINE LATE TIMES]
	@test -n "$(SUBMISSIONS)" -a -n "$(LESSONS)" || (echo "usage: make grade-class SUBMISSIONS=dir LESSONS=01,02,03 [FROM=NN] [OUT=dir] [ISOLATION=auto|namespaces|uid|none] [POINTS=file] [PARTIAL=tests|all] [DEADLINE=iso] [LATE='10%/day, max 50%'] [TIMES=file.csv]" && exit 2)
	$(PY) -m course.classgrade "$(SUBMISSIONS)" --lessons "$(LESSONS)" --out "$(OUT)" --isolation $(ISOLATION) \
		$(if $(FROM),--from $(FROM)) $(if $(POINTS),--points "$(POINTS)") $(if $(PARTIAL),--partial $(PARTIAL)) \
		$(if $(DEADLINE),--deadline "$(DEADLINE)") $(if $(LATE),--late "$(LATE)") $(if $(TIMES),--times "$(TIMES)")

# Instructors: Gradescope's autograder bundle for lesson L (FROM=NN: lessons FROM..L) in build/gradescope/.
gradescope: $(STAMP) ## instructor: Gradescope's autograder zip for lesson L -> build/gradescope/ | L=NN [FROM LATE DEADLINE POINTS PARTIAL]
	@test -n "$(L)" || (echo "usage: make gradescope L=NN [FROM=NN] [LATE='10%/day'] [DEADLINE=iso] [POINTS=file] [PARTIAL=tests|all]" && exit 2)
	$(PY) -m course.gradescope build $(L) $(if $(FROM),--from $(FROM)) $(if $(LATE),--late "$(LATE)") \
		$(if $(DEADLINE),--deadline "$(DEADLINE)") $(if $(POINTS),--points "$(POINTS)") $(if $(PARTIAL),--partial $(PARTIAL))

# Lecturers: each lesson's executed demo notebook as an offline reveal.js slideshow in build/slides/
# (runs the demo unless build/demo/ has it; reveal.js and MathJax come from the `slides` extra, installed
# once; SHOTS=1 opens each in headless Chromium: a screenshot NN_topic.png, and a check that it loads
# nothing from the network and typesets every formula; SMALL=1 runs the demo small, MINITORCH_SMALL=1,
# into build/slides/small/: a quick preview, not the lecture's figures).
SLIDES_STAMP := .venv/.slides
$(SLIDES_STAMP): $(STAMP)
	@mkdir -p build && $(PY) -m pip install -q -c $(CONSTRAINTS) -e ".[slides]" > build/setup-slides.log 2>&1 || \
		(cat build/setup-slides.log; exit 1)
	@touch $(SLIDES_STAMP)

slides: $(STAMP) $(SLIDES_STAMP) $(if $(SHOTS),$(BROWSER_STAMP)) ## lecturer: offline reveal.js slides of the demo -> build/slides/ | L=NN SHOTS=1 SMALL=1
	OPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) $(PY) -m course.slides $(L) $(if $(SHOTS),--screenshot) $(if $(SMALL),--small)

# Lecturers: serve the tiny GPT (lesson 15) on http://127.0.0.1:$(PORT)/ until Ctrl-C
# (the first Ctrl-C finishes the requests in flight, a second stops at once).
PORT ?= 8000
serve: $(STAMP) ## lecturer: serve lesson 15's tiny GPT on http://127.0.0.1:PORT/ | PORT=8000
	$(PY) -c "from minitorch.api_server import serve; serve(port=$(PORT))"

# Lessons 12, 13, 16: an emulated cluster on this machine (Linux, root; course/cluster.py) until Ctrl-C, then removed:
# NODES nodes of PPN ranks, each rank's NIC shaped to LINK. run(fn, N, engine="mpi", nodes=NODES) runs on it.
NODES ?= 2
PPN ?= 2
LINK ?= 2gbit
cluster: $(STAMP) ## lecturer: an emulated cluster of network namespaces, until Ctrl-C (Linux, root) | NODES=2 PPN=2 LINK=2gbit
	$(PY) -m course.cluster up --nodes $(NODES) --ppn $(PPN) --link $(LINK)

# The course as a website (course/site.py; docs/maintainers.md, "The site"): every lesson executed (make demo's
# full-size outputs for the lessons whose full run takes minutes, the small preview mode for the others), the
# hardware notes, docs/, a glossary, offline search -> build/site/html/ (L=NN: one lesson, build/site/lesson-NN/).
# SMALL=1: every lesson small; RUN=1: execute again outputs whose lesson changed (else the build fails);
# ANSWERS=1: show the reference solutions; REPO=owner/name: the Colab and GitHub links.
SITE_ARGS = $(L) $(if $(SMALL),--small) $(if $(RUN),--run) $(if $(ANSWERS),--answers) $(if $(REPO),--repo $(REPO))
site: $(STAMP) $(SITE_STAMP) ## lecturer: the course as a website -> build/site/html/ | L=NN SMALL=1 RUN=1 ANSWERS=1 REPO=owner/name
	OPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) $(PY) -m course.site $(SITE_ARGS)

site-test: $(STAMP) $(SITE_STAMP) $(BROWSER_STAMP) ## maintainer: make site, then open every page in headless Chromium | L=NN SMALL=1
	OPENBLAS_NUM_THREADS=$(BLAS_THREADS) MKL_NUM_THREADS=$(BLAS_THREADS) $(PY) -m course.site --test $(SITE_ARGS)

SITE_PORT ?= 8001
site-serve: $(STAMP) ## lecturer: serve the built site on http://127.0.0.1:SITE_PORT/ | L=NN SITE_PORT=8001
	$(PY) -m course.site --serve --port $(SITE_PORT) $(L)

bench: $(STAMP) ## maintainer: the performance tables and plots -> build/bench/ | L=name
	$(PY) -m benchmarks $(L)

# On a GPU machine, with its own Python (no venv, no Jupyter needed): make gpu-report PY=python3
# (`make gpucheck` is its old name).
gpu-report: ## maintainer: every GPU check, on a GPU machine -> build/gpu_report.md | PY=python3
	$(PY) -m course.gpu_report

gpucheck: gpu-report ## alias

# The targets above, grouped by who uses them, from their `## who: what | settings` comments.
help: ## all: this list (the default target)
	@awk 'BEGIN { split("student lecturer instructor maintainer all", order, " ");                         \
	              title["student"] = "Students"; title["lecturer"] = "Lecturers";                           \
	              title["instructor"] = "Instructors"; title["maintainer"] = "Maintainers"; title["all"] = "" } \
	      /^[a-zA-Z][a-zA-Z0-9_-]*: [a-zA-Z0-9_-]+ ## alias$$/ { sub(/ ## alias$$/, ""); sub(/: /, " (now: ");     \
	          alias = alias (alias == "" ? "" : ", ") $$0 ")" }                                                   \
	      /^[a-zA-Z][a-zA-Z0-9_-]*:.*## [a-z]+: / {                                                        \
	          name = $$0; sub(/:.*/, "", name); text = $$0; sub(/^[^#]*## /, "", text);                       \
	          who = text; sub(/:.*/, "", who); sub(/^[a-z]+: /, "", text); how = "";                          \
	          i = index(text, " | "); if (i) { how = substr(text, i + 3); text = substr(text, 1, i - 1) }     \
	          if (length(text) > 61 && how != "") line = sprintf("  make %-13s %s\n%83s%s\n", name, text, "", how); \
	          else line = sprintf("  make %-13s %-61s %s\n", name, text, how);                               \
	          lines[who] = lines[who] line }                                                                  \
	      END { print "make TARGET [SETTING=value ...]   (targets set up .venv first where it is missing)";   \
	            for (k = 1; k <= 5; k++) { w = order[k]; if (!(w in lines)) continue;                          \
	                if (title[w] != "") print "\n" title[w]; else print ""; printf "%s", lines[w] }            \
	            print "\nOld names that still work: " alias ". The guides: README.md and docs/." }' $(firstword $(MAKEFILE_LIST))

# >>> student Makefile (as above)
clean: ## maintainer: remove build/ and the caches
	rm -rf build .pytest_cache
	find . -name __pycache__ -not -path "./.venv/*" -prune -exec rm -rf {} +
# <<< student Makefile
