"""Metrics of generated recipes: the usual text-overlap scores and recipe-specific checks.

`generation_metrics(generated, references, prompts, template)` is what `trainer evaluate` prints and what the
training loop logs at each evaluation (`eval/rougeL`, `eval/ingredient_coverage`, ...). It returns only the
metrics that are defined for the data given:

- `rouge1`, `rouge2`, `rougeL`: mean F1 (`rouge-score`, Porter stemmer) x 100, over records with a reference;
- `bleu`, `chrf`: corpus scores from `sacrebleu` (0-100), over records with a reference;
- `ingredient_coverage`: per record, the share of the prompt's ingredients whose core words all appear in the
  generated text, averaged over records whose prompt lists ingredients;
- `invented_ingredients`: per record, the share of generated ingredient lines whose core words match no prompt
  ingredient (neither contains the other), averaged over records whose prompt lists ingredients and whose
  generated text has an ingredient list;
- `structure`: share of generations that follow the target template with a title, at least one ingredient
  and directions numbered from 1 (each as far as the template has them);
- `repetition`: mean share of repeated word 4-grams in a generated text (0: none repeats);
- `length_ratio`: generated words / reference words, summed over records with a reference.

An ingredient line's *core words*: lower-cased (NFKC), without parentheses, cut at the first comma and the
first " or ", without numbers, units and preparation words, plurals folded ("2 (8 oz.) cans black beans,
drained" -> {black, bean}).
"""

from __future__ import annotations

import logging
import re
import unicodedata
from collections.abc import Sequence

from trainer.data.prompt import PromptTemplate, parse_recipe

__all__ = [
    "core_words",
    "generation_metrics",
    "ingredient_coverage",
    "invented_share",
    "repeated_ngram_share",
    "structure_ok",
]


def _word_set(text: str) -> frozenset[str]:
    return frozenset(text.split())


UNITS = _word_set(
    """
    cup cups c tablespoon tablespoons tbsp tbs tbsps tbl tb teaspoon teaspoons tsp tsps t ounce ounces oz
    fl pound pounds lb lbs gram grams g kg kilogram kilograms ml milliliter milliliters millilitre l liter
    liters litre litres quart quarts qt pint pints pt gallon gallons gal pinch pinches dash dashes drop drops
    can cans jar jars package packages pkg pkgs packet packets box boxes bag bags bottle bottles container
    containers carton cartons stick sticks slice slices piece pieces sprig sprigs bunch bunches head heads
    clove cloves handful handfuls inch inches envelope envelopes scoop scoops
    """
)

# Words that say how much, how prepared or how big, not what.
DESCRIPTORS = _word_set(
    """
    a an the of and to for with about approximately plus taste optional needed more less few some each
    fresh freshly frozen dried chopped finely coarsely roughly thinly minced diced sliced grated shredded
    crushed ground peeled seeded cored halved quartered cubed melted softened warmed cooled cold hot warm room
    temperature large small medium extra whole beaten divided packed heaping level rounded cooked uncooked
    drained rinsed trimmed lightly well good quality
    """
)

_WORD = re.compile(r"[^\W\d_]+")


def _singular(w: str) -> str:
    if len(w) > 4 and w.endswith("ies"):
        return w[:-3] + "y"  # berries -> berry
    if len(w) > 4 and w.endswith(("oes", "ches", "shes", "sses", "xes")):
        return w[:-2]  # tomatoes -> tomato, peaches -> peach
    if len(w) > 3 and w.endswith("s") and not w.endswith(("ss", "us", "is")):
        return w[:-1]  # eggs -> egg
    return w


def _words(text: str) -> list[str]:
    return _WORD.findall(unicodedata.normalize("NFKC", text).lower())


def core_words(line: str) -> frozenset[str]:
    """The words that name an ingredient line's ingredient (see the module doc); empty when none do."""
    text = re.sub(r"\([^)]*\)", " ", unicodedata.normalize("NFKC", line).lower())
    text = text.split(",")[0].split(" or ")[0]
    return frozenset(
        _singular(w) for w in _words(text) if len(w) > 1 and w not in UNITS and w not in DESCRIPTORS
    )


def ingredient_coverage(prompt_ingredients: Sequence[str], generated: str) -> float | None:
    """Share of the prompt's ingredients whose core words all appear in `generated`; None when no prompt
    ingredient has core words."""
    cores = [c for c in map(core_words, prompt_ingredients) if c]
    if not cores:
        return None
    text = {_singular(w) for w in _words(generated)}
    return sum(c <= text for c in cores) / len(cores)


def invented_share(prompt_ingredients: Sequence[str], generated_ingredients: Sequence[str]) -> float | None:
    """Share of generated ingredient lines whose core words match no prompt ingredient's (neither set contains
    the other); None when there is nothing to compare."""
    prompt = [c for c in map(core_words, prompt_ingredients) if c]
    lines = [c for c in map(core_words, generated_ingredients) if c]
    if not prompt or not lines:
        return None
    invented = sum(not any(p <= g or g <= p for p in prompt) for g in lines)
    return invented / len(lines)


def repeated_ngram_share(text: str, n: int = 4) -> float:
    """Share of the word n-grams of `text` that repeat an earlier one (0.0 for fewer than n words)."""
    words = text.lower().split()
    grams = [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]
    return 1.0 - len(set(grams)) / len(grams) if grams else 0.0


def structure_ok(generated: str, target_template: str) -> bool:
    """Whether `generated` follows the target template with a title, ingredients and directions numbered from
    1, as far as the template has each."""
    r = parse_recipe(generated, target_template)
    if r is None:
        return False
    return (
        (r.title is None or bool(r.title))
        and (r.ingredients is None or bool(r.ingredients))
        and (r.directions is None or (bool(r.directions) and r.directions_numbered))
    )


def _mean(values: list[float | None]) -> float | None:
    kept = [v for v in values if v is not None]
    return sum(kept) / len(kept) if kept else None


def generation_metrics(
    generated: Sequence[str],
    references: Sequence[str | None],
    prompts: Sequence[str],
    template: PromptTemplate,
) -> dict[str, float]:
    """Metric name -> value over generations, their references (None where a record has none) and the prompts
    they came from, read with `template` (see the module doc for each metric)."""
    if not len(generated) == len(references) == len(prompts):
        raise ValueError(
            f"{len(generated)} generations, {len(references)} references, {len(prompts)} prompts"
        )
    out: dict[str, float] = {}
    pairs = [(g, r) for g, r in zip(generated, references, strict=True) if r is not None]
    if pairs:
        import sacrebleu
        from rouge_score import rouge_scorer

        # rouge-score logs "Using default tokenizer." at every call.
        logging.getLogger("absl").setLevel(logging.WARNING)
        scorer = rouge_scorer.RougeScorer(["rouge1", "rouge2", "rougeL"], use_stemmer=True)
        scores = [scorer.score(r, g) for g, r in pairs]
        for name in ("rouge1", "rouge2", "rougeL"):
            out[name] = 100 * sum(s[name].fmeasure for s in scores) / len(scores)
        hyps, refs = [g for g, _ in pairs], [r for _, r in pairs]
        out["bleu"] = sacrebleu.corpus_bleu(hyps, [refs]).score
        out["chrf"] = sacrebleu.corpus_chrf(hyps, [refs]).score
        ref_words = sum(len(r.split()) for r in refs)
        if ref_words:
            out["length_ratio"] = sum(len(g.split()) for g in hyps) / ref_words
    coverage, invented = [], []
    for g, p in zip(generated, prompts, strict=True):
        source = parse_recipe(p, template.source_template)
        if source is None or not source.ingredients:
            continue
        coverage.append(ingredient_coverage(source.ingredients, g))
        target = parse_recipe(g, template.target_template)
        invented.append(invented_share(source.ingredients, target.ingredients or []) if target else None)
    for name, values in (("ingredient_coverage", coverage), ("invented_ingredients", invented)):
        if (value := _mean(values)) is not None:
            out[name] = value
    if generated:
        out["structure"] = sum(structure_ok(g, template.target_template) for g in generated) / len(generated)
        out["repetition"] = sum(map(repeated_ngram_share, generated)) / len(generated)
    return out
