"""Recipe metrics on handmade examples whose right answers are stated beside them."""

from __future__ import annotations

import pytest

from trainer.config import GENERATION_METRICS
from trainer.data.prompt import PromptTemplate, parse_recipe
from trainer.eval.recipe_metrics import (
    core_words,
    generation_metrics,
    ingredient_coverage,
    invented_share,
    repeated_ngram_share,
    structure_ok,
)

TEMPLATE = PromptTemplate.preset("ingredients-to-recipe")
TARGET = TEMPLATE.target_template


@pytest.mark.parametrize(
    "line,core",
    [
        ("2 (8 oz.) cans black beans, drained", {"black", "bean"}),
        ("1 1/2 cups all-purpose flour", {"all", "purpose", "flour"}),
        ("3 large eggs", {"egg"}),
        ("½ tsp. salt, or to taste", {"salt"}),
        ("1/2 cup butter or margarine, softened", {"butter"}),
        ("4 ripe Tomatoes", {"ripe", "tomato"}),
        ("2 c. fresh blueberries", {"blueberry"}),
        ("2 cups", set()),
    ],
)
def test_core_words(line: str, core: set[str]) -> None:
    assert core_words(line) == core


def test_ingredient_coverage_counts_prompt_ingredients_named_anywhere_in_the_recipe() -> None:
    prompt = ["2 cups flour", "3 large eggs", "1 cup milk", "1 tsp vanilla extract"]
    generated = (
        "title: Cake | ingredients: flour; eggs | directions: 1. Mix flour, eggs and vanilla. 2. Bake."
    )
    # flour and eggs are named; vanilla extract needs both core words; milk is missing: 2 of 4.
    assert ingredient_coverage(prompt, generated) == 0.5
    assert ingredient_coverage(prompt, generated + " Add the milk and vanilla extract.") == 1.0
    assert ingredient_coverage(["2 cups", "1 pinch"], generated) is None  # nothing nameable in the prompt


def test_invented_share_is_the_generated_lines_no_prompt_ingredient_matches() -> None:
    prompt = ["2 cups flour", "3 eggs"]
    generated = ["1 cup all-purpose flour", "2 eggs", "1 cup sugar", "salt"]
    # all-purpose flour contains flour, eggs match; sugar and salt are invented: 2 of 4.
    assert invented_share(prompt, generated) == 0.5
    assert invented_share(prompt, ["flour", "egg"]) == 0.0
    assert invented_share(prompt, []) is None


def test_repeated_ngram_share() -> None:
    # 8 words, five 4-grams, one repeats "a b c d": 1/5.
    assert repeated_ngram_share("a b c d a b c d") == pytest.approx(0.2)
    assert repeated_ngram_share("Mix well and bake for ten minutes") == 0.0
    assert repeated_ngram_share("too short") == 0.0
    assert repeated_ngram_share("x x x x x x") == pytest.approx(2 / 3)  # three 4-grams, all the same


def test_structure_needs_title_ingredients_and_numbered_directions() -> None:
    good = "title: Pie | ingredients: 1 egg; 2 cups flour | directions: 1. Mix. 2. Bake at 350. 3. Cool."
    assert structure_ok(good, TARGET)
    assert not structure_ok("title: Pie | ingredients: 1 egg | directions: Mix and bake.", TARGET)
    assert not structure_ok("title: Pie | ingredients: 1 egg; 2 cups flour", TARGET)  # cut before directions
    assert not structure_ok("title:  | ingredients: 1 egg | directions: 1. Mix.", TARGET)
    assert not structure_ok("2 cups 2 cups 2 cups", TARGET)


def test_parse_recipe_reads_the_template_back() -> None:
    r = parse_recipe(
        "title: Pie | ingredients: 1 egg; 2 cups flour | directions: 1. Heat to 350. 2. Bake.", TARGET
    )
    assert r is not None
    assert (r.title, r.ingredients, r.directions) == (
        "Pie",
        ["1 egg", "2 cups flour"],
        ["Heat to 350.", "Bake."],
    )
    assert r.directions_numbered
    # Decoded text may differ in spaces; the literal parts still separate the fields.
    r = parse_recipe("title:Pie  |ingredients: a |  directions: 1. Mix.", TARGET)
    assert r is not None and (r.title, r.ingredients, r.directions) == ("Pie", ["a"], ["Mix."])
    assert parse_recipe(
        "Write a recipe with these ingredients: 2 eggs; milk", TEMPLATE.source_template
    ).ingredients == [
        "2 eggs",
        "milk",
    ]
    custom = "{{recipe}} {title} -- {ner}"
    r = parse_recipe("{recipe} Soup -- carrot, onion", custom)
    assert r is not None and (r.title, r.ner) == ("Soup", ["carrot", "onion"])


def test_generation_metrics_perfect_and_partial() -> None:
    reference = (
        "title: Pancakes | ingredients: 2 cups flour; 2 eggs; 1 cup milk | directions: 1. Whisk. 2. Fry."
    )
    prompt = "Write a recipe with these ingredients: 2 cups flour; 2 eggs; 1 cup milk"
    m = generation_metrics([reference], [reference], [prompt], TEMPLATE)
    assert m["rouge1"] == m["rouge2"] == m["rougeL"] == pytest.approx(100.0)
    assert m["bleu"] == pytest.approx(100.0) and m["chrf"] == pytest.approx(100.0)
    assert m["ingredient_coverage"] == 1.0 and m["invented_ingredients"] == 0.0
    assert m["structure"] == 1.0 and m["repetition"] == 0.0 and m["length_ratio"] == 1.0
    assert sorted(m) == sorted(GENERATION_METRICS)  # what metric_for_best_model may name

    # Two records: one without a reference (text metrics over the other only), one off-template generation.
    off = "pancakes pancakes pancakes pancakes pancakes"
    m = generation_metrics([reference, off], [None, reference], [prompt, prompt], TEMPLATE)
    assert m["rouge1"] < 20 and m["length_ratio"] == pytest.approx(5 / len(reference.split()))
    assert m["structure"] == 0.5
    assert m["ingredient_coverage"] == 0.5  # all three in the first, none in the second
    assert m["invented_ingredients"] == 0.0  # only the first has an ingredient list to judge
    assert m["repetition"] == pytest.approx((0 + 1 / 2) / 2)  # "pancakes" x5: two 4-grams, one repeats

    # A title prompt has no ingredients: no ingredient metrics; no references: no text metrics.
    title = PromptTemplate.preset("title-to-recipe")
    m = generation_metrics([reference], [None], ["Write a recipe for: Pancakes"], title)
    assert set(m) == {"structure", "repetition"}
