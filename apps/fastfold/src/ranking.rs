//! What `run_alphafold.py` writes beside the models of one query: the models ranked by
//! confidence (`ranked_<i>.pdb`, `ranking_debug.json`) and the time each step took
//! (`timings.json`), in AlphaFold's formats.
use std::path::Path;

use serde_json::{json, Map, Value};

/// The measure models are ranked by.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Measure {
    /// Mean pLDDT (AlphaFold's monomer ranking; `ranking_debug.json` key `plddts`).
    Plddt,
    /// Predicted TM-score, when every model has the aligned-error head (`_ptm` sets; key
    /// `ptm`).
    Ptm,
}

/// The models of one query, best first.
#[derive(Clone, Debug, PartialEq)]
pub struct Ranking {
    /// What the scores are.
    pub measure: Measure,
    /// Each model's score, in the order the models ran.
    pub scores: Vec<(String, f64)>,
    /// Model names, highest score first (ties keep the running order, as Python's stable
    /// sort does).
    pub order: Vec<String>,
}

impl Ranking {
    /// Ranks `(model, mean pLDDT, pTM)`: by pTM when every model has one, else by pLDDT.
    pub fn new(models: &[(String, f64, Option<f64>)]) -> Ranking {
        let ptm: Option<Vec<f64>> = models.iter().map(|m| m.2).collect();
        let (measure, scores): (Measure, Vec<f64>) = match ptm {
            Some(ptm) if !models.is_empty() => (Measure::Ptm, ptm),
            _ => (Measure::Plddt, models.iter().map(|m| m.1).collect()),
        };
        let scores: Vec<(String, f64)> = models.iter().map(|m| m.0.clone()).zip(scores).collect();
        let mut order: Vec<&(String, f64)> = scores.iter().collect();
        order.sort_by(|a, b| b.1.total_cmp(&a.1));
        let order = order.into_iter().map(|(name, _)| name.clone()).collect();
        Ranking { measure, scores, order }
    }

    /// AlphaFold's `ranking_debug.json`: `{"plddts" | "ptm": {model: score}, "order": [...]}`.
    pub fn to_json(&self) -> Value {
        let label = match self.measure {
            Measure::Plddt => "plddts",
            Measure::Ptm => "ptm",
        };
        let scores: Map<String, Value> = self.scores.iter().map(|(n, s)| (n.clone(), json!(s))).collect();
        json!({ label: scores, "order": self.order })
    }

    /// Writes `ranking_debug.json` to `path` (through a temporary file).
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        write_json(path, &self.to_json())
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

    /// Writes `timings.json` to `path` (through a temporary file).
    pub fn write(&self, path: &Path) -> anyhow::Result<()> {
        let map: Map<String, Value> = self.0.iter().map(|(k, s)| (k.clone(), json!(s))).collect();
        write_json(path, &Value::Object(map))
    }
}

fn write_json(path: &Path, value: &Value) -> anyhow::Result<()> {
    data::write_atomic(path, |w| -> anyhow::Result<()> { Ok(serde_json::to_writer_pretty(w, value)?) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ptm_ranks_when_every_model_has_it_else_mean_plddt() {
        let m = |n: &str, plddt: f64, ptm: Option<f64>| (n.to_string(), plddt, ptm);
        let r = Ranking::new(&[m("model_1_ptm", 80.0, Some(0.5)), m("model_2_ptm", 70.0, Some(0.7))]);
        assert_eq!(r.order, ["model_2_ptm", "model_1_ptm"]);
        assert_eq!(r.to_json(), json!({"ptm": {"model_1_ptm": 0.5, "model_2_ptm": 0.7}, "order": r.order}));
        let r = Ranking::new(&[m("model_1", 60.0, None), m("model_2_ptm", 70.0, Some(0.7)), m("model_3", 60.0, None)]);
        assert_eq!(r.measure, Measure::Plddt);
        assert_eq!(r.order, ["model_2_ptm", "model_1", "model_3"], "ties keep the running order");
    }
}
