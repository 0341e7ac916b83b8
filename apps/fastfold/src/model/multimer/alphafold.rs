//! The whole AlphaFold-Multimer network (DeepMind's `modules_multimer.AlphaFold`,
//! `AlphaFoldIteration` and `EmbeddingsAndEvoformer`) over one parameter file
//! (`params_model_N_multimer_v3.npz` or its `.safetensors`), recycling as DeepMind's v2.3 does.
//!
//! One pass, given the previous pass's outputs and its JAX key:
//! 1. the MSA sampled from the key ([`sampling`](super::sampling)): the key's second half
//!    (`AlphaFoldIteration`'s ensemble split) splits in three, the second sampling the rows,
//!    the third masking them;
//! 2. the input embedding with the relative encoding over chains ([`MultimerInputEmbedder`]),
//!    the recycled MSA row, pair and pseudo-beta distances (the monomer's
//!    [`RecyclingEmbedder`], the same arrays);
//! 3. the templates' pair update ([`MultimerTemplates`]), the extra-MSA stack on the first
//!    `num_extra_msa` unsampled rows, the templates' MSA rows ([`MultimerTemplateRows`]), the
//!    Evoformer (outer product mean first); both stacks without the fully-masked rows
//!    ([`masked_rows`]: the outputs are the same);
//! 4. the single projection, the structure module
//!    ([`Variant::Multimer`](crate::model::structure::Variant::Multimer)) and the heads.
//!
//! Recycling ([`MultimerAlphaFold::predict`]) follows v2.3's loop: a pass runs from the zero
//! state; while fewer than `num_recycle` recycles have run and (before the first) or the last
//! one moved the CA distances by more than the tolerance ([`ca_distance_change`]), another
//! runs, each under the second half of the loop key's split (the first half the next loop
//! key); then one last pass under the loop key as it stands, whose outputs are returned.
//!
//! In training (an [`Exec`] with dropout rates), each pass's stacks drop with the keys
//! `EmbeddingsAndEvoformer` hands them ([`stack_keys`]): what is left of its key after the
//! sampling's split, split once for the templates (when the network has them) and once for
//! the extra-MSA stack, whose chain's last key is split once more for the Evoformer. The
//! structure module drops from [`structure_key`] of the pass key (ours).
use std::path::Path;

use kernels::Backend;
use tch::{Device, Kind, Tensor};

use crate::jax_random::Key;
use crate::memory::AttentionLogits;
use crate::model::alphafold::{evoformer_msa_input, extra_msa_input, run_stack, Pass};
use crate::model::config::{EvoformerConfig, ModelConfig, TemplateConfig};
use crate::model::embedders::{pseudo_beta, ExtraMsaEmbedder, Recycled, RecyclingEmbedder};
use crate::model::evoformer::EvoformerStack;
use crate::model::exec::{ChunkOp, Exec};
use crate::model::heads::{HeadInputs, Heads};
use crate::model::keys::{EMBEDDINGS, ITERATION, SINGLE_TEMPLATE};
use crate::model::layers::Stream;
use crate::model::masked_rows::{self, MsaRows};
use crate::model::multimer::msa_feat::encode_deletions;
use crate::model::multimer::relpos::{ChainIds, MultimerInputEmbedder};
use crate::model::multimer::sampling::{FullMsa, MsaSampling, SampledMsa};
use crate::model::multimer::structure::{structure_module, MULTIMER_STRUCTURE_ITERATIONS};
use crate::model::multimer::template_rows::MultimerTemplateRows;
use crate::model::multimer::templates::{MultimerTemplates, TemplateBatch};
use crate::model::multimer::Arrays;
use crate::model::pair_rows::PairRows;
use crate::model::params::Params;
use crate::model::recycling::{ca_distance_change, Recycling};
use crate::model::structure::StructureModule;
use crate::model::AttentionKernel;
use crate::model::{ensure, Error, Result};

/// The network's inputs: AlphaFold-Multimer's features of one complex, under the names its
/// input pipeline gives them (`fastfold::multimer::MultimerFeatures`, whose `get` feeds
/// [`MultimerInputs::from_named`]): per residue `[N]`, per MSA row [S, N] or `[S]`, per
/// template [T, ...].
pub struct MultimerInputs {
    /// `[N]` residue types 0-20.
    pub aatype: Tensor,
    /// `[N]` residue numbers within each chain.
    pub residue_index: Tensor,
    /// `[N]` chain (1-based).
    pub asym_id: Tensor,
    /// `[N]` entity (1-based).
    pub entity_id: Tensor,
    /// `[N]` copy of the entity (1-based).
    pub sym_id: Tensor,
    /// `[N]` 1 for real residues.
    pub seq_mask: Tensor,
    /// [S, N] classes 0-21.
    pub msa: Tensor,
    /// [S, N].
    pub deletion_matrix: Tensor,
    /// [S, N].
    pub msa_mask: Tensor,
    /// [S, N].
    pub bert_mask: Tensor,
    /// `[S]` 1 for rows always kept as cluster centres.
    pub cluster_bias_mask: Tensor,
    /// [T, N] template residue types (`template_aatype`), when there are template features.
    pub template_aatype: Option<Tensor>,
    /// [T, N, 37, 3] (`template_all_atom_positions`).
    pub template_all_atom_positions: Option<Tensor>,
    /// [T, N, 37] (`template_all_atom_mask`).
    pub template_all_atom_mask: Option<Tensor>,
}

impl MultimerInputs {
    /// The features from arrays named as AlphaFold names them (`get(name)`: `None` when
    /// absent); the template features are optional, all three or none. `source` names where
    /// they came from in errors.
    pub fn from_named(get: impl Fn(&str) -> Option<Tensor>, source: &str) -> Result<Self> {
        let need =
            |name: &str| get(name).ok_or_else(|| Error::Invalid(format!("{source}: the feature {name} is missing")));
        let templates = ["template_aatype", "template_all_atom_positions", "template_all_atom_mask"].map(&get);
        let present = templates.iter().filter(|t| t.is_some()).count();
        ensure!(
            present == 0 || present == 3,
            "{source}: template_aatype, template_all_atom_positions and template_all_atom_mask come together; \
             {present} of them are there"
        );
        let [template_aatype, template_all_atom_positions, template_all_atom_mask] = templates;
        Ok(MultimerInputs {
            aatype: need("aatype")?,
            residue_index: need("residue_index")?,
            asym_id: need("asym_id")?,
            entity_id: need("entity_id")?,
            sym_id: need("sym_id")?,
            seq_mask: need("seq_mask")?,
            msa: need("msa")?,
            deletion_matrix: need("deletion_matrix")?,
            msa_mask: need("msa_mask")?,
            bert_mask: need("bert_mask")?,
            cluster_bias_mask: need("cluster_bias_mask")?,
            template_aatype,
            template_all_atom_positions,
            template_all_atom_mask,
        })
    }

    /// Residues N.
    pub fn residues(&self) -> Result<i64> {
        match self.aatype.size().as_slice() {
            [n] => Ok(*n),
            _ => Err(Error::Invalid(format!("aatype: expected shape [residues], found {:?}", self.aatype.size()))),
        }
    }

    fn full_msa(&self) -> FullMsa<'_> {
        FullMsa {
            msa: &self.msa,
            deletion_matrix: &self.deletion_matrix,
            msa_mask: &self.msa_mask,
            bert_mask: &self.bert_mask,
            cluster_bias_mask: &self.cluster_bias_mask,
        }
    }

    fn templates(&self) -> Option<TemplateBatch<'_>> {
        match (&self.template_aatype, &self.template_all_atom_positions, &self.template_all_atom_mask) {
            (Some(aatype), Some(positions), Some(mask)) if aatype.size().first().is_some_and(|&t| t > 0) => {
                Some(TemplateBatch { aatype, positions, mask })
            }
            _ => None,
        }
    }
}

/// The keys one pass's sampling draws from: `AlphaFoldIteration` splits the pass key in two
/// and hands the second to `EmbeddingsAndEvoformer`, which splits it in three: the rows'
/// key, then the masking's.
pub fn sampling_keys(pass_key: Key) -> (Key, Key) {
    let keys = pass_key.split(2)[1].split(3);
    (keys[1], keys[2])
}

/// The keys one pass's stacks drop with: `EmbeddingsAndEvoformer`'s key (the first of the
/// split in three whose others sample the MSA, [`sampling_keys`]) split for the templates
/// (`templates`: when the config has them) and then for the extra-MSA stack. Returns the
/// template pair stack's key and the extra-MSA stack's; the Evoformer's is
/// [`evoformer_key`] of the extra-MSA stack's chain end.
pub fn stack_keys(pass_key: Key, templates: bool) -> (Option<Key>, Key) {
    let mut key = pass_key.split(2)[1].split(3)[0];
    let mut template_key = None;
    if templates {
        let k = key.split(2);
        (key, template_key) = (k[0], Some(k[1]));
    }
    (template_key, key.split(2)[1])
}

/// The structure module's key from the pass's: the first half of the pass key's split, which
/// DeepMind's `AlphaFoldIteration` leaves unused (its structure module draws from haiku's rng
/// sequence instead, which this network does not reproduce: a derivation of ours).
pub fn structure_key(pass_key: Key) -> Key {
    pass_key.split(2)[0]
}

/// The Evoformer's key from the extra-MSA stack's chain end (`safe_key, safe_subkey =
/// safe_key.split()` before the Evoformer's layer stack).
pub fn evoformer_key(extra_chain_end: Key) -> Key {
    extra_chain_end.split(2)[1]
}

/// The key the network draws from for a run's seed: DeepMind's `RunModel.predict` applies the
/// haiku model with `jax.random.PRNGKey(seed)`, and `modules_multimer.AlphaFold` takes haiku's
/// first `next_rng_key()` of it, the second half of its split.
pub fn network_key(seed: u64) -> Key {
    Key::from_seed(seed as i64).split(2)[1]
}

/// The network over one parameter file.
pub struct MultimerAlphaFold {
    input: MultimerInputEmbedder,
    recycling: RecyclingEmbedder,
    templates: Option<(MultimerTemplates, MultimerTemplateRows)>,
    extra_embedder: ExtraMsaEmbedder,
    extra: EvoformerStack,
    evoformer: EvoformerStack,
    heads: Heads,
    structure: StructureModule,
    config: EvoformerConfig,
    model: ModelConfig,
    /// Bytes of the parameters.
    param_bytes: u64,
    kind: Kind,
    device: Device,
    /// How each pass samples the MSA (v2.3's sizes by default).
    pub sampling: MsaSampling,
    drop_masked_rows: bool,
    /// How its attentions hold their logits without autograd (for the memory plan).
    logits: AttentionLogits,
}

impl MultimerAlphaFold {
    /// The network over an AlphaFold-Multimer parameter file, every width read from the
    /// shapes, the structure module running its 8 iterations. Every array the modules need must
    /// be there with the shape the widths imply, and every array of the file must have a user,
    /// else the error names the keys and the file.
    pub fn load(path: impl AsRef<Path>) -> Result<Self> {
        Self::load_with_iterations(path, MULTIMER_STRUCTURE_ITERATIONS)
    }

    /// [`MultimerAlphaFold::load`] with the structure module running `iterations` iterations.
    pub fn load_with_iterations(path: impl AsRef<Path>, iterations: i64) -> Result<Self> {
        Self::load_on(path, iterations, Device::Cpu, None, (Backend::Torch, AttentionKernel::Logits))
    }

    /// [`MultimerAlphaFold::load_with_iterations`] with the arrays on `device`, where the
    /// network then runs, and with `kind` converted to it (`Kind::BFloat16`: the network
    /// computes in bf16 as the monomer's does, the structure module's geometry in fp32); else
    /// in the file's own kind; its modules running `kernels` (the fused CUDA kernels, with
    /// which attention without autograd, or libtorch's compositions).
    pub fn load_on(
        path: impl AsRef<Path>,
        iterations: i64,
        device: Device,
        kind: Option<Kind>,
        kernels: (Backend, AttentionKernel),
    ) -> Result<Self> {
        Self::from_arrays(Arrays::open(path.as_ref())?.into_device(device, kind)?, iterations, device, kernels)
    }

    /// The network over `params`' arrays themselves (shared, not copied: a store whose arrays
    /// require gradients trains this network), on their device, running their kernels, the
    /// structure module running `iterations` iterations;
    /// [`load_multimer_params`](super::load_multimer_params) reads one.
    pub fn from_params(params: &Params, iterations: i64) -> Result<Self> {
        let (_, first) = params.iter().next().ok_or_else(|| Error::Invalid("an empty parameter store".into()))?;
        let device = first.device();
        let arrays = params.iter().map(|(k, t)| (k.to_string(), t.shallow_clone())).collect();
        let arrays = Arrays { arrays, file: "the parameter store".into() };
        Self::from_arrays(arrays, iterations, device, params.kernels())
    }

    fn from_arrays(
        arrays: Arrays,
        iterations: i64,
        device: Device,
        kernels: (Backend, AttentionKernel),
    ) -> Result<Self> {
        let file = arrays.file.clone();
        let kind = arrays.kind(&format!("{EMBEDDINGS}/single_activations//weights"))?;
        let config = EvoformerConfig::infer(&arrays.arrays).map_err(|e| Error::Invalid(format!("{file}: {e}")))?;
        ensure!(
            config.outer_product_mean_first,
            "{file} is not an AlphaFold-Multimer parameter file (it has no relative chain encoding)"
        );
        ensure!(config.num_extra_blocks > 0, "{file}: AlphaFold-Multimer's parameters have an extra-MSA stack");
        let mut model = heads_config(&arrays)?;
        let param_bytes = crate::memory::bytes_of(arrays.arrays.values());
        let b = arrays.shared_builder().with_kernels(kernels);
        let templates = match arrays.contains(&format!("{SINGLE_TEMPLATE}/query_embedding_norm//scale")) {
            true => {
                Some((MultimerTemplates::from_arrays(&arrays, &b)?, MultimerTemplateRows::from_arrays(&arrays, &b)?))
            }
            false => None,
        };
        let structure = structure_module(&arrays, &b, iterations)?;
        model.structure = *structure.config();
        let network = MultimerAlphaFold {
            input: MultimerInputEmbedder::from_arrays(&arrays, &b)?,
            recycling: RecyclingEmbedder::build(&b, &config, &model)?,
            templates,
            extra_embedder: ExtraMsaEmbedder::build(&b, &config)?,
            extra: EvoformerStack::build(&b, &config, true)?,
            evoformer: EvoformerStack::build(&b, &config, false)?,
            heads: Heads::build(&b, &config, &model)?,
            structure,
            config,
            model,
            param_bytes,
            kind,
            device,
            sampling: MsaSampling::default(),
            drop_masked_rows: true,
            logits: AttentionLogits::of(kernels),
        };
        let unused = b.unused_under("");
        ensure!(
            unused.is_empty(),
            "{file}: {} arrays no module uses (is an array of their module missing?): {:?}",
            unused.len(),
            &unused[..unused.len().min(8)]
        );
        Ok(network)
    }

    /// The same network sampling `sampling`'s rows.
    pub fn with_sampling(mut self, sampling: MsaSampling) -> Self {
        self.sampling = sampling;
        self
    }

    /// Whether the stacks leave out fully-masked rows ([`masked_rows`]; on by default): the
    /// outputs are the same either way, the time falls with the real depth. Off runs every
    /// padding row, as DeepMind's code does.
    pub fn drop_masked_rows(mut self, drop: bool) -> Self {
        self.drop_masked_rows = drop;
        self
    }

    /// Whether the stacks leave out fully-masked rows.
    pub fn drops_masked_rows(&self) -> bool {
        self.drop_masked_rows
    }

    /// The stacks' sizes.
    pub fn config(&self) -> &EvoformerConfig {
        &self.config
    }

    /// The heads', recycling embedder's and structure module's sizes.
    pub fn model_config(&self) -> &ModelConfig {
        &self.model
    }

    /// Bytes of the parameters (on the network's device).
    pub fn param_bytes(&self) -> u64 {
        self.param_bytes
    }

    /// How its attentions hold their logits without autograd.
    pub fn attention_logits(&self) -> AttentionLogits {
        self.logits
    }

    /// The template stack's sizes, when the parameters have one.
    pub fn template_config(&self) -> Option<&TemplateConfig> {
        self.templates.as_ref().map(|(t, _)| t.config())
    }

    /// The zero state the first pass starts from.
    pub fn initial_state(&self, features: &MultimerInputs) -> Result<Recycled> {
        self.zero_state(&PairRows::whole(features.residues()?))
    }

    /// Zeros of the network's kind and device, the pair the rows `rows` holds.
    fn zero_state(&self, rows: &PairRows) -> Result<Recycled> {
        let like = Tensor::f_zeros([1], (self.kind, self.device()))?;
        Recycled::zeros(rows, &self.config, &like)
    }

    fn device(&self) -> Device {
        self.device
    }

    /// One pass (`AlphaFoldIteration`) on `features` from the previous pass's outputs, its
    /// MSA sampled from `key`.
    pub fn pass(&self, features: &MultimerInputs, prev: Recycled, key: Key, exec: &Exec) -> Result<Pass> {
        Ok(self.sampled_pass(features, prev, key, exec)?.0)
    }

    /// [`MultimerAlphaFold::pass`], and the MSA it sampled (whose `true_msa` and `bert_mask` the
    /// masked-MSA loss reads).
    pub fn sampled_pass(
        &self,
        features: &MultimerInputs,
        prev: Recycled,
        key: Key,
        exec: &Exec,
    ) -> Result<(Pass, SampledMsa)> {
        let (kind, device) = (self.kind, self.device());
        let (sample_key, mask_key) = sampling_keys(key);
        let (template_key, extra_key) = stack_keys(key, self.templates.is_some());
        // No key reaches the stacks outside training: nothing is drawn.
        let training = exec.dropout().is_some();
        let template_key = template_key.filter(|_| training);
        let sampled = self.sampling.sample(&features.full_msa(), sample_key, mask_key)?;
        let to = |t: &Tensor| -> Result<Tensor> { Ok(t.f_to_kind(kind)?.f_to_device(device)?) };
        let aatype = features.aatype.f_to_kind(Kind::Int64)?.f_to_device(device)?;
        let seq_mask = to(&features.seq_mask)?;
        let ids = [&features.residue_index, &features.asym_id, &features.entity_id, &features.sym_id]
            .map(|t| t.f_to_kind(Kind::Int64).and_then(|t| t.f_to_device(device)));
        let [residue_index, asym_id, entity_id, sym_id] = ids;
        let (residue_index, asym_id, entity_id, sym_id) = (residue_index?, asym_id?, entity_id?, sym_id?);
        let chains =
            ChainIds { residue_index: &residue_index, asym_id: &asym_id, entity_id: &entity_id, sym_id: &sym_id };

        // The pair first, whole or under DAP inference this rank's rows (see the monomer's
        // pass and `crate::model::pair_rows`): the MSA is embedded after the extra-MSA stack,
        // which does not read it (nor do the templates), so that a long complex's MSA is not
        // held through their largest steps. Only the recycled row it needs is made now.
        let pair_rows = PairRows::for_pass(exec, aatype.size()[0]);
        let prev = Recycled { pair: pair_rows.recycled(exec.dap(), prev.pair)?, ..prev };
        let (block, real) = pair_rows.into_block(self.input.embed_pair(&aatype, kind, &chains, exec, &pair_rows)?)?;
        let mut pair = Stream::new(real, true);
        let recycled_row = self.recycling.first_row(&prev)?;
        self.recycling.update_pair(&mut pair, &prev, exec, &pair_rows)?;
        drop(prev);
        let pair_mask = seq_mask.f_unsqueeze(1)?.f_mul(&seq_mask.f_unsqueeze(0)?)?;
        let template_features = features.templates();
        let template_batch = match &template_features {
            Some(t) => Some((to(t.aatype)?, to(t.positions)?, to(t.mask)?)),
            None => None,
        };
        if let (Some((embedding, _)), Some((aatype, positions, mask))) = (&self.templates, &template_batch) {
            let batch = TemplateBatch { aatype, positions, mask };
            embedding.add_update(&mut pair, &batch, &pair_mask, &asym_id, exec, template_key, &pair_rows)?;
        }
        let pair = pair_rows.embedded(block, pair.into_inner());
        let extra_key = training.then_some(extra_key);
        let (pair, extra_end) = self.extra_stack(&sampled, pair, &pair_mask, exec, extra_key, &pair_rows)?;
        // The sampled MSA's rows joined by the templates'; only the rows that run are
        // embedded, under DAP only the rank's (`evoformer_msa_input`).
        let msa_feat = to(&sampled.msa_feat()?)?;
        let own_rows = msa_feat.size()[0];
        let mut msa_mask = to(&sampled.msa_mask)?;
        let mut template_rows = None;
        if let (Some((_, rows)), Some((aatype, positions, mask))) = (&self.templates, &template_batch) {
            let (rows, row_mask) = rows.forward(&TemplateBatch { aatype, positions, mask }, kind)?;
            msa_mask = Tensor::f_cat(&[msa_mask, row_mask.f_to_kind(kind)?], 0)?;
            template_rows = Some(rows);
        }
        let rows = MsaRows::choose(self.drop_masked_rows, &msa_feat, &msa_mask, own_rows)?;
        let msa_mask = rows.select(&msa_mask)?;
        let embed = |features: &Tensor| self.input.embed_msa(&aatype, features);
        let features = (&msa_feat, recycled_row, template_rows.as_ref());
        let msa = evoformer_msa_input(embed, &self.recycling, features, &rows, exec, &pair_rows)?;
        drop((msa_feat, template_rows));
        let evo_key = extra_end.map(evoformer_key);
        let masks = (&msa_mask, &pair_mask);
        let (msa, pair, _) = run_stack(&self.evoformer, (msa, pair), masks, exec, &pair_rows, evo_key)?;
        // What the pass reads of the MSA's own rows (the template rows end here), on the device
        // (an offloading Evoformer leaves the MSA on the host), before the structure module:
        // the MSA is gone before the pass's last steps.
        let readout = self.heads.read_msa(msa, &rows, device)?;
        let ipa_chunk = exec.chunk_for(ChunkOp::StructureAttention);
        let dropout = exec.dropout().map(|d| (structure_key(key), d.structure_module));
        let real = pair_rows.real_of(&pair)?;
        let structure =
            self.structure.run_rows(&readout.single, &real, &pair_rows, &aatype, &seq_mask, ipa_chunk, dropout)?;
        let inputs =
            HeadInputs { msa: &readout, pair: &real, pair_rows: &pair_rows, structure_single: &structure.single };
        let heads = self.heads.forward(&inputs)?;
        drop(real);
        let pseudo_beta = pseudo_beta(&aatype, &structure.atom37)?.f_to_kind(kind)?;
        let (single, msa_first_row) = (readout.single, readout.first_row);
        let recycled = Recycled { msa_first_row, pair, pseudo_beta };
        Ok((Pass { heads, structure, single, recycled, pair_rows }, sampled))
    }

    /// The extra-MSA stack on the first `num_extra_msa` unsampled rows, their fully-masked
    /// rows left out when the network drops them (one masked row of gaps when none is left: it
    /// changes the pair no more than no rows would).
    /// With `key`, the stack drops in training and its key chain's end is returned.
    fn extra_stack(
        &self,
        sampled: &SampledMsa,
        pair: Tensor,
        pair_mask: &Tensor,
        exec: &Exec,
        key: Option<Key>,
        pair_rows: &PairRows,
    ) -> Result<(Tensor, Option<Key>)> {
        let (kind, device) = (self.kind, self.device());
        let rows = sampled.extra_msa.size()[0].min(self.sampling.num_extra_msa.max(0));
        let kept = match self.drop_masked_rows {
            true => masked_rows::unmasked_rows(&sampled.extra_msa_mask.f_narrow(0, 0, rows)?)?,
            false => None,
        };
        // The first `rows` rows, without the fully-masked ones when they are left out.
        let take = |t: &Tensor| -> Result<Tensor> {
            let t = t.f_narrow(0, 0, rows)?;
            Ok(match &kept {
                Some(kept) => t.f_index_select(0, kept)?,
                None => t,
            })
        };
        let (msa, deletions, mask) =
            (take(&sampled.extra_msa)?, take(&sampled.extra_deletion_matrix)?, take(&sampled.extra_msa_mask)?);
        let (extra_msa, deletions, mask) = match msa.size()[0] {
            0 => {
                const GAP: i64 = 21;
                let n = pair_rows.residues();
                let zeros = Tensor::f_zeros([1, n], (Kind::Float, Device::Cpu))?;
                (Tensor::f_full([1, n], GAP, (Kind::Int64, Device::Cpu))?, zeros.f_zeros_like()?, zeros)
            }
            _ => (msa, deletions, mask),
        };
        let to = |t: &Tensor| -> Result<Tensor> { Ok(t.f_to_kind(kind)?.f_to_device(device)?) };
        let has_deletion = to(&deletions.f_clamp(0.0, 1.0)?)?;
        let deletion_value = to(&encode_deletions(&deletions)?)?;
        let features = (&extra_msa.f_to_device(device)?, &has_deletion, &deletion_value);
        let extra = extra_msa_input(&self.extra_embedder, features, kind, exec, pair_rows)?;
        let masks = (&to(&mask)?, pair_mask);
        let (_, pair, end) = run_stack(&self.extra, (extra, pair), masks, exec, pair_rows, key)?;
        Ok((pair, end))
    }

    /// Inference with v2.3's recycling (see the module docs) from the JAX key `key`
    /// (`jax.random.PRNGKey(seed)` is [`Key::from_seed`]): at most `recycling.max` recycles,
    /// fewer once one moves the CA distances by no more than `recycling.early_stop_tolerance`
    /// Å; returns the last pass and the recycles run before it. The recycles run without
    /// autograd; the last pass keeps its graph unless the caller runs under `tch::no_grad`.
    pub fn predict(
        &self,
        features: &MultimerInputs,
        recycling: Recycling,
        key: Key,
        exec: &Exec,
    ) -> Result<(Pass, usize)> {
        let (pass, _, done) = self.recycle(features, recycling, key, exec)?;
        Ok((pass, done))
    }

    /// A training forward: `recycles` passes without autograd under v2.3's key splits (no
    /// early stop), then the last pass with its graph; returns it and the MSA it sampled from
    /// its key (the masked-MSA loss's targets). Every pass samples its MSA inside the
    /// network, as in inference.
    pub fn train_forward(
        &self,
        features: &MultimerInputs,
        recycles: usize,
        key: Key,
        exec: &Exec,
    ) -> Result<(Pass, SampledMsa)> {
        // Every CA change exceeds minus infinity: all `recycles` run.
        let recycling = Recycling { max: recycles, early_stop_tolerance: f64::NEG_INFINITY };
        let (pass, sampled, _) = self.recycle(features, recycling, key, exec)?;
        Ok((pass, sampled))
    }

    /// v2.3's recycling loop (see the module docs): the last pass, its sampled MSA and the
    /// recycles run before it.
    fn recycle(
        &self,
        features: &MultimerInputs,
        recycling: Recycling,
        key: Key,
        exec: &Exec,
    ) -> Result<(Pass, SampledMsa, usize)> {
        let n = features.residues()?;
        // The recycles run without autograd: under DAP they start from this rank's rows.
        let mut prev = self.zero_state(&tch::no_grad(|| PairRows::for_pass(exec, n)))?;
        let zeros = || Tensor::f_zeros([n, 37, 3], (Kind::Float, self.device()));
        // The positions the last recycle started from, and those it ended at.
        let (mut before, mut after) = (zeros()?, zeros()?);
        let seq_mask = features.seq_mask.f_to_device(self.device())?;
        let (mut key, mut done) = (key, 0);
        loop {
            let more = done < recycling.max
                && (done == 0 || ca_distance_change(&before, &after, &seq_mask)? > recycling.early_stop_tolerance);
            if !more {
                let (pass, sampled) = self.sampled_pass(features, prev, key, exec)?;
                return Ok((pass, sampled, done));
            }
            let keys = key.split(2);
            let pass = tch::no_grad(|| self.pass(features, prev, keys[1], exec))?;
            before = std::mem::replace(&mut after, pass.structure.atom37.f_to_kind(Kind::Float)?);
            prev = pass.recycled;
            key = keys[0];
            done += 1;
        }
    }
}

/// The heads' and recycling embedder's sizes from the shapes of a Multimer file (whose
/// embedders differ from the monomer's, so [`ModelConfig::infer`] does not apply).
fn heads_config(arrays: &Arrays) -> Result<ModelConfig> {
    let e = |module: &str, dim: usize| arrays.size(&format!("{EMBEDDINGS}/{module}//weights"), 2, dim);
    let h = |module: &str, dim: usize| arrays.size(&format!("{ITERATION}/{module}//weights"), 2, dim);
    Ok(ModelConfig {
        c_s: e("single_activations", 1)?,
        recycle_bins: e("prev_pos_linear", 0)?,
        distogram_bins: h("distogram_head/half_logits", 1)?,
        lddt_bins: h("predicted_lddt_head/logits", 1)?,
        lddt_channels: h("predicted_lddt_head/act_0", 1)?,
        masked_msa_classes: h("masked_msa_head/logits", 1)?,
        resolved_atoms: h("experimentally_resolved_head/logits", 1)?,
        aligned_error_bins: Some(h("predicted_aligned_error_head/logits", 1)?),
        templates: None,
        ..ModelConfig::default()
    })
}
