//! What `run_alphafold.py` writes beside the models of one query: the models ranked by
//! confidence (`ranked_<i>.pdb`, `ranking_debug.json`) and the time each step took
//! (`timings.json`), in AlphaFold's formats: `json.dumps(..., indent=4)` of Python dicts,
//! whose keys keep the order they were added in.
use std::path::Path;

use serde::ser::{SerializeMap, Serializer};
use serde::Serialize;

/// The models of one query, best first, by mean pLDDT: AlphaFold's monomer pipelines rank
/// every model this way (`ranking_confidence = mean(plddt)`), the `_ptm` sets too, the pTM
/// staying in the confidence files; AlphaFold-Multimer ranks its predictions by `iptm+ptm`
/// ([`Ranking::multimer`]).
#[derive(Clone, Debug, PartialEq)]
pub struct Ranking {
    /// Each model's mean pLDDT, in the order the models ran.
    pub scores: Vec<(String, f64)>,
    /// Model names, highest score first (ties keep the running order, as Python's stable
    /// sort does).
    pub order: Vec<String>,
    /// The scores' key in `ranking_debug.json`: `plddts` (monomer models) or `iptm+ptm`
    /// (AlphaFold-Multimer's `0.8 ipTM + 0.2 pTM`).
    pub score_name: &'static str,
}

impl Ranking {
    /// Ranks `(model, mean pLDDT)`.
    pub fn new(models: &[(String, f64)]) -> Ranking {
        let scores = models.to_vec();
        let mut order: Vec<&(String, f64)> = scores.iter().collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1));
        let order = order.into_iter().map(|(name, _)| name.clone()).collect();
        Ranking { scores, order, score_name: "plddts" }
    }

    /// Ranks AlphaFold-Multimer's predictions by `(name, 0.8 ipTM + 0.2 pTM)`, its
    /// `ranking_debug.json` keyed `iptm+ptm`.
    pub fn multimer(predictions: &[(String, f64)]) -> Ranking {
        Ranking { score_name: "iptm+ptm", ..Ranking::new(predictions) }
    }

    /// AlphaFold's `ranking_debug.json`: `{"plddts": {model: score}, "order": [...]}` (or
    /// `iptm+ptm` for Multimer), the models in the order they ran.
    pub fn to_json(&self) -> anyhow::Result<String> {
        to_json(&RankingDebug(self))
    }

    /// Writes `ranking_debug.json` to `path` (through a temporary file).
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        write_json(path, &self.to_json()?)
    }
}

/// Seconds per step, under AlphaFold's keys (`features`, `process_features_<model>`,
/// `predict_and_compile_<model>`), in the order they ran.
#[derive(Clone, Debug, Default)]
pub struct Timings(Vec<(String, f64)>);

impl Timings {
    /// Records `seconds` under `key`.
    pub fn add(&mut self, key: impl Into<String>, seconds: f64) {
        self.0.push((key.into(), seconds));
    }

    /// `timings.json`: `{step: seconds}` in the order the steps ran.
    pub fn to_json(&self) -> anyhow::Result<String> {
        to_json(&InOrder(&self.0))
    }

    /// Writes `timings.json` to `path` (through a temporary file).
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        write_json(path, &self.to_json()?)
    }
}

/// A JSON object of `(key, number)` entries in their order. serde_json's `Map` sorts its keys
/// (its `preserve_order` feature would change every JSON file of the workspace), so the
/// entries are serialised one by one.
struct InOrder<'a>(&'a [(String, f64)]);

impl Serialize for InOrder<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(self.0.len()))?;
        for (key, value) in self.0 {
            map.serialize_entry(key, value)?;
        }
        map.end()
    }
}

/// `ranking_debug.json`'s object: the scores under the ranking's key, then the order.
struct RankingDebug<'a>(&'a Ranking);

impl Serialize for RankingDebug<'_> {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        let mut map = serializer.serialize_map(Some(2))?;
        map.serialize_entry(self.0.score_name, &InOrder(&self.0.scores))?;
        map.serialize_entry("order", &self.0.order)?;
        map.end()
    }
}

/// `value` as Python's `json.dumps(value, indent=4)` writes it.
fn to_json(value: &impl Serialize) -> anyhow::Result<String> {
    let mut text = Vec::new();
    let formatter = serde_json::ser::PrettyFormatter::with_indent(b"    ");
    value.serialize(&mut serde_json::Serializer::with_formatter(&mut text, formatter))?;
    Ok(String::from_utf8(text)?)
}

fn write_json(path: &Path, text: &str) -> anyhow::Result<()> {
    use std::io::Write;
    data::write_atomic(path, |w| -> anyhow::Result<()> { Ok(w.write_all(text.as_bytes())?) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn models_rank_by_mean_plddt_even_with_ptm() {
        // The old ranking took pTM when every model had one: model_2_ptm (pTM 0.7) first.
        let m = |n: &str, plddt: f64| (n.to_string(), plddt);
        let r = Ranking::new(&[m("model_1_ptm", 80.0), m("model_2_ptm", 70.0)]);
        assert_eq!(r.order, ["model_1_ptm", "model_2_ptm"]);
        let json: serde_json::Value = serde_json::from_str(&r.to_json().unwrap()).unwrap();
        let want = serde_json::json!({"plddts": {"model_1_ptm": 80.0, "model_2_ptm": 70.0}, "order": r.order});
        assert_eq!(json, want);
        let r = Ranking::new(&[m("model_1", 60.0), m("model_2_ptm", 70.0), m("model_3", 60.0)]);
        assert_eq!(r.order, ["model_2_ptm", "model_1", "model_3"], "ties keep the running order");
        let r = Ranking::multimer(&[m("model_1_multimer_v3_pred_0", 0.5), m("model_1_multimer_v3_pred_1", 0.7)]);
        let json: serde_json::Value = serde_json::from_str(&r.to_json().unwrap()).unwrap();
        let order = ["model_1_multimer_v3_pred_1", "model_1_multimer_v3_pred_0"];
        let want = serde_json::json!({"iptm+ptm": {"model_1_multimer_v3_pred_0": 0.5, "model_1_multimer_v3_pred_1": 0.7}, "order": order});
        assert_eq!(json, want);
    }

    #[test]
    fn json_keeps_the_order_the_steps_and_models_ran_in() {
        // serde_json's Map sorted the keys: `predict_and_compile_*` before `process_features_*`,
        // `order` before `plddts`, model_5 before model_3.
        let mut t = Timings::default();
        for (key, seconds) in [
            ("features", 1.5),
            ("process_features_model_5", 0.25),
            ("predict_and_compile_model_5", 2.0),
            ("process_features_model_3", 0.5),
            ("predict_and_compile_model_3", 3.0),
        ] {
            t.add(key, seconds);
        }
        let want = "{\n    \"features\": 1.5,\n    \"process_features_model_5\": 0.25,\n    \
                    \"predict_and_compile_model_5\": 2.0,\n    \"process_features_model_3\": 0.5,\n    \
                    \"predict_and_compile_model_3\": 3.0\n}";
        let dir = suite_tests::scratch("fastfold", "ranking");
        let written = |name: &str| std::fs::read_to_string(dir.join(name)).unwrap();
        t.write(&dir.join("timings.json")).unwrap();
        assert_eq!(written("timings.json"), want);
        let r = Ranking::new(&[("model_5".into(), 70.0), ("model_3".into(), 80.0)]);
        let want = "{\n    \"plddts\": {\n        \"model_5\": 70.0,\n        \"model_3\": 80.0\n    },\n    \
                    \"order\": [\n        \"model_3\",\n        \"model_5\"\n    ]\n}";
        r.write(&dir.join("ranking_debug.json")).unwrap();
        assert_eq!(written("ranking_debug.json"), want, "as json.dumps(indent=4) writes it");
    }
}
